"""A transfer handler on Flask 3.1 (Werkzeug's server) that counts its executions."""
import sys
import threading

from flask import Flask, jsonify, request

app = Flask(__name__)
lock = threading.Lock()
executions = 0


@app.post("/v1/transfers")
def transfer():
    global executions
    with lock:
        executions += 1
        n = executions
    return jsonify(n=n), 201


@app.post("/v1/accounts/<id>/transfers")
def account_transfer(id):
    """A parameterised handler: the account it is handed and the method it ran."""
    global executions
    with lock:
        executions += 1
        n = executions
    return jsonify(n=n, account=id, method=request.method), 201


@app.get("/count")
def count():
    return jsonify(n=executions)


if __name__ == "__main__":
    app.run(host="127.0.0.1", port=int(sys.argv[1]), threaded=True)
