// A transfer handler on Express 5 (its default routing: case-insensitive, non-strict)
// that counts its executions.
const express = require("express");

const app = express();
let executions = 0;

app.post("/v1/transfers", (req, res) => {
  executions += 1;
  res.status(201).json({ n: executions });
});

// A parameterised handler: the account it is handed and the method it ran.
app.post("/v1/accounts/:id/transfers", (req, res) => {
  executions += 1;
  res.status(201).json({ n: executions, account: req.params.id, method: req.method });
});

app.get("/count", (req, res) => {
  res.json({ n: executions });
});

app.listen(Number(process.argv[2]), "127.0.0.1");
