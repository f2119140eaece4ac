// Transfer handlers on Koa 2 with @koa/router 13 (its default routing: case-insensitive,
// non-strict; parameters decoded with `+` as a space) that count their executions.
const Koa = require("koa");
const Router = require("@koa/router");

const app = new Koa();
const router = new Router();
let executions = 0;

router.post("/v1/transfers", (ctx) => {
  executions += 1;
  ctx.status = 201;
  ctx.body = { n: executions };
});

// A parameterised handler: the account it is handed and the method it ran.
router.post("/v1/accounts/:id/transfers", (ctx) => {
  executions += 1;
  ctx.status = 201;
  ctx.body = { n: executions, account: ctx.params.id, method: ctx.method };
});

router.get("/count", (ctx) => {
  ctx.body = { n: executions };
});

app.use(router.routes());
app.listen(Number(process.argv[2]), "127.0.0.1");
