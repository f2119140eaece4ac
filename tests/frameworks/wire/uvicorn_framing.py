"""uvicorn with httptools, no framework: an ASGI app that sets both Content-Length and
Transfer-Encoding, which uvicorn writes as set (the body chunked). Counts the POSTs it ran."""

import json
import sys

import uvicorn

executions = 0
# 106 bytes.
LONG = ('{"id":"tr_1","note":"' + "x" * 83 + '"}').encode()


async def app(scope, receive, send):
    global executions
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    path = scope["path"]
    if path == "/count":
        body = json.dumps({"n": executions}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    if scope["method"] == "POST":
        executions += 1
    if path == "/both":
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"8"),
            (b"transfer-encoding", b"chunked"),
        ]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": LONG})
        return
    body = b'{"balance":"B-own"}'
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), http="httptools", log_level="warning")
