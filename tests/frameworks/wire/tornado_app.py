"""Tornado's default routing: a transfer handler that answers with the account it was
handed (a raw byte beyond ASCII in the path is read as Latin-1) and counts its executions."""

import sys

import tornado.ioloop
import tornado.web

executions = 0


class Transfers(tornado.web.RequestHandler):
    def post(self, account):
        global executions
        executions += 1
        self.set_status(201)
        self.write({"n": executions, "account": account, "method": self.request.method})


class Count(tornado.web.RequestHandler):
    def get(self):
        self.write({"n": executions})


if __name__ == "__main__":
    app = tornado.web.Application(
        [(r"/v1/accounts/([^/]+)/transfers", Transfers), (r"/count", Count)]
    )
    app.listen(int(sys.argv[1]), "127.0.0.1")
    tornado.ioloop.IOLoop.current().start()
