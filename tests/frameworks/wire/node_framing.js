// Node's own `http`, no framework: answers framed as an app can make Node frame them. An app
// that sets both Content-Length and Transfer-Encoding gets both on the wire, and a length
// that its body does not match is written as set. Counts the POSTs it ran.
const http = require("http");

let executions = 0;
// 106 bytes.
const LONG = '{"id":"tr_1","note":"' + "x".repeat(83) + '"}';

const server = http.createServer((req, res) => {
  req.resume();
  req.on("end", () => {
    if (req.url === "/count") {
      res.setHeader("content-type", "application/json");
      res.end(JSON.stringify({ n: executions }));
      return;
    }
    if (req.method === "POST") executions += 1;
    switch (req.url) {
      case "/both":
        res.writeHead(201, {
          "content-type": "application/json",
          "content-length": "8",
          "transfer-encoding": "chunked",
        });
        res.end(LONG);
        return;
      case "/long":
        // A declared length longer than the body, then the connection ends.
        res.writeHead(201, { "content-type": "application/json", "content-length": "50" });
        res.write('{"id":1}');
        setTimeout(() => res.socket.destroy(), 50);
        return;
      case "/short":
        // A declared length shorter than the body, all of which is written.
        res.writeHead(201, { "content-type": "application/json", "content-length": "8" });
        res.end('{"id":1}{"balance":"POISONED-9999"}');
        return;
      case "/upgrade":
        res.socket.write(
          "HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n"
        );
        return;
      case "/head":
        res.writeHead(200, { "content-length": "100" });
        res.end();
        return;
      default:
        res.setHeader("content-type", "application/json");
        res.end('{"balance":"B-own"}');
    }
  });
});
server.listen(Number(process.argv[2]), "127.0.0.1");
