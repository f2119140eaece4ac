// Transfer handlers on Fastify 5 (find-my-way's default routing: case-sensitive, trailing
// slash and duplicate slashes significant) that count their executions.
const fastify = require("fastify")();

let executions = 0;

fastify.post("/v1/transfers", async (req, reply) => {
  executions += 1;
  reply.code(201);
  return { n: executions };
});

// A parameterised handler: the account it is handed and the method it ran.
fastify.post("/v1/accounts/:id/transfers", async (req, reply) => {
  executions += 1;
  reply.code(201);
  return { n: executions, account: req.params.id, method: req.method };
});

// Form bodies are accepted (and ignored) so that a `_method` field reaches the handler.
fastify.addContentTypeParser(
  ["application/x-www-form-urlencoded", "multipart/form-data"],
  { parseAs: "string" },
  (req, body, done) => done(null, body),
);

fastify.get("/count", async () => ({ n: executions }));

fastify.listen({ port: Number(process.argv[2]), host: "127.0.0.1" });
