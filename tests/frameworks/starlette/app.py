"""Transfer handlers on Starlette 1.10 (FastAPI's router) under uvicorn that count their
executions."""
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

executions = 0


async def transfer(request):
    global executions
    executions += 1
    return JSONResponse({"n": executions}, status_code=201)


async def account_transfer(request):
    """A parameterised handler: the account it is handed and the method it ran."""
    global executions
    executions += 1
    body = {"n": executions, "account": request.path_params["id"], "method": request.method}
    return JSONResponse(body, status_code=201)


async def count(request):
    return JSONResponse({"n": executions})


app = Starlette(
    routes=[
        Route("/v1/transfers", transfer, methods=["POST"]),
        Route("/v1/accounts/{id}/transfers", account_transfer, methods=["POST"]),
        Route("/count", count, methods=["GET"]),
    ]
)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
