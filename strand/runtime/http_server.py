"""The HTTP server: SGLang's native API and the OpenAI API over the tokenizer manager.

`launch_server` starts the scheduler and detokenizer processes, waits until both are ready,
then serves HTTP with uvicorn on uvloop until SIGINT/SIGTERM or until a child dies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the string annotations here

from strand.runtime.errors import InvalidRequestError
from strand.runtime.server_args import ServerArgs

logger = logging.getLogger("strand.server")

_CHILD_POLL_S = 0.5
_HEALTH_GENERATE_TIMEOUT_S = 60.0


def _error(status: int, message: str, param: str | None = None, kind: str | None = None):
    from fastapi.responses import JSONResponse

    kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    503: "service_unavailable"}.get(status, "server_error")
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": status}},
    )


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"


def _abort_status(results: list[dict]) -> tuple[int, str, str | None] | None:
    """If a request was refused after submission (grammar compile failure, server dying), its
    finish_reason carries the HTTP status to answer with."""
    for r in results:
        fr = r["meta_info"].get("finish_reason") or {}
        if fr.get("type") == "abort" and fr.get("status_code"):
            message = str(fr.get("message", "aborted"))
            field, sep, _ = message.partition(": ")
            param = field if sep and field.replace(".", "").replace("_", "").isalnum() else None
            return int(fr["status_code"]), message, param
    return None


class ApiKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which hides client disconnects from the endpoints):
    every path but /health* and /metrics needs `Authorization: Bearer KEY`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not (scope["path"].startswith("/health") or scope["path"] == "/metrics"):
            auth = dict(scope.get("headers") or []).get(b"authorization")
            if auth != self.expected:
                response = _error(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                  kind="authentication_error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(tm, children: dict | None = None, on_ready=None):
    """The FastAPI app over a started-or-startable TokenizerManager `tm`."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    from strand.runtime import openai_api
    from strand.runtime.tokenizer_manager import ClientDisconnected, OverloadedError, ServerDeadError

    @asynccontextmanager
    async def lifespan(app):
        tm.start()
        tasks = []
        if on_ready is not None:
            tasks.append(asyncio.get_running_loop().create_task(on_ready()))
        yield
        for t in tasks:
            t.cancel()

    app = FastAPI(title="Strand", lifespan=lifespan)
    api_key = tm.server_args.api_key

    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    async def read_json(request: Request):
        body = await request.body()
        if not body:
            return None
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequestError("body", f"is not valid JSON: {e}") from None

    def guard(handler):
        """Turn the request errors every endpoint can raise into their HTTP answers."""
        import functools

        @functools.wraps(handler)
        async def wrapped(request: Request):
            try:
                return await handler(request)
            except InvalidRequestError as e:
                return _error(400, str(e), param=e.field)
            except OverloadedError as e:
                return _error(503, str(e))
            except ServerDeadError as e:
                return _error(503, f"the server is shutting down: {e}")
            except asyncio.TimeoutError:
                return _error(503, "the scheduler did not answer in time")
            except ClientDisconnected:
                return Response(status_code=499)  # nobody is listening any more

        return wrapped

    # ---- native API --------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if tm.dead_reason:
            return _error(503, tm.dead_reason)
        return Response(status_code=200)

    @app.get("/health_generate")
    @guard
    async def health_generate(request: Request):
        from strand.runtime.sampling_params import SamplingParams

        inp = tm.make_input(rid=f"health-{os.urandom(6).hex()}", prompt=[0], field_name="input_ids",
                            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
        states = tm.submit([inp])
        try:
            results = await asyncio.wait_for(tm.wait_all(states), _HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            tm.abort_states(states)
            return _error(503, "no generation within the timeout")
        if _abort_status(results):
            return _error(503, _abort_status(results)[1])
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        return {
            "model_path": tm.model_path,
            "tokenizer_path": tm.server_args.tokenizer_path or tm.model_path,
            "served_model_name": tm.served_model_name,
            "is_generation": True,
            "context_length": tm.context_length,
            "vocab_size": tm.vocab_size,
        }

    async def server_info(request: Request):
        stats = (await tm.control("get_stats")).payload
        args = dataclasses.asdict(tm.server_args)
        args["api_key"] = None if args.get("api_key") is None else "***"
        return {
            **args,
            "model_path": tm.model_path,
            "context_length": tm.context_length,
            "max_total_tokens": tm.max_total_tokens,
            "scheduler_stats": stats,
            **{k: v for k, v in stats.items() if k not in args},
            "version": _version(),
        }

    app.get("/get_server_info")(guard(server_info))
    app.get("/server_info")(guard(server_info))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    @guard
    async def flush_cache(request: Request):
        out = await tm.control("flush_cache")
        message = out.payload.get("message", "")
        if out.ok:
            return PlainTextResponse(f"Cache flushed. {message}".strip(), status_code=200)
        return _error(400, f"cache not flushed: {message}")

    @app.post("/abort_request")
    @guard
    async def abort_request(request: Request):
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
            raise InvalidRequestError("rid", "must be a string")
        found = tm.abort(body["rid"])
        return {"success": found}

    @app.get("/metrics")
    async def metrics():
        try:
            stats = (await tm.control("get_stats", timeout=5.0)).payload
        except (asyncio.TimeoutError, ServerDeadError):
            stats = None
        return PlainTextResponse(tm.metrics.render(stats, tm.served_model_name),
                                 media_type="text/plain; version=0.0.4")

    @app.api_route("/generate", methods=["POST", "PUT"])
    @guard
    async def generate(request: Request):
        inputs, batch = tm.parse_native(await read_json(request))
        states = tm.submit(inputs)
        multi = batch or len(states) > 1
        if inputs[0].stream:
            async def events():
                async for index, out in tm.stream(states):
                    if multi:
                        out["index"] = index
                    status = _abort_status([out])
                    if status:
                        yield _sse({"error": {"message": status[1], "code": status[0]}, **out})
                    else:
                        yield _sse(out)
                yield _SSE_DONE

            return StreamingResponse(events(), media_type="text/event-stream")
        results = await tm.wait_all(states, request.is_disconnected)
        status = _abort_status(results)
        if status:
            return _error(*status)
        return JSONResponse(results if multi else results[0])

    # ---- OpenAI API ------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": tm.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "strand", "root": tm.model_path, "max_model_len": tm.context_length,
        }]}

    async def openai_generate(request: Request, parse, respond):
        req = parse(tm, await read_json(request))
        states = tm.submit(req.inputs)
        if req.stream:
            fmt = openai_api.StreamFormatter(req, len(states))

            async def events():
                async for index, out in tm.stream(states):
                    status = _abort_status([out])
                    if status:
                        yield _sse({"error": {"message": status[1], "type": "invalid_request_error"
                                              if status[0] == 400 else "server_error", "code": status[0]}})
                        continue
                    for chunk in fmt.chunks(index, out):
                        yield _sse(chunk)
                tail = fmt.usage_chunk()
                if tail is not None:
                    yield _sse(tail)
                yield _SSE_DONE

            return StreamingResponse(events(), media_type="text/event-stream")
        results = await tm.wait_all(states, request.is_disconnected)
        status = _abort_status(results)
        if status:
            return _error(*status)
        return JSONResponse(respond(req, results))

    @app.post("/v1/completions")
    @guard
    async def completions(request: Request):
        return await openai_generate(request, openai_api.parse_completion, openai_api.completion_response)

    @app.post("/v1/chat/completions")
    @guard
    async def chat_completions(request: Request):
        return await openai_generate(request, openai_api.parse_chat, openai_api.chat_response)

    return app


def _version() -> str:
    import strand

    return strand.__version__


# ---- processes ---------------------------------------------------------------------------------


class ChildProcesses:
    """The scheduler and detokenizer processes: start, wait until ready, watch, stop."""

    def __init__(self, server_args: ServerArgs):
        self.server_args = server_args
        self.tmpdir = tempfile.mkdtemp(prefix="strand-ipc-")
        self.paths = {
            "scheduler": f"ipc://{self.tmpdir}/scheduler",
            "detokenizer": f"ipc://{self.tmpdir}/detokenizer",
            "tokenizer": f"ipc://{self.tmpdir}/tokenizer",
        }
        self.procs: dict[str, multiprocessing.Process] = {}
        self.ready_conns: dict[str, Any] = {}

    def start(self) -> None:
        from strand.runtime.detokenizer import run_detokenizer_process
        from strand.runtime.scheduler_process import run_scheduler_process

        ctx = multiprocessing.get_context("spawn")
        p = self.paths
        targets = {
            "scheduler": (run_scheduler_process, (p["scheduler"], p["detokenizer"], p["tokenizer"])),
            "detokenizer": (run_detokenizer_process, (p["detokenizer"], p["tokenizer"])),
        }
        for name, (target, paths) in targets.items():
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, args=(self.server_args, *paths, writer),
                               name=f"strand-{name}", daemon=True)
            proc.start()
            writer.close()
            self.procs[name] = proc
            self.ready_conns[name] = reader
            logger.info("started the %s process (pid %d)", name, proc.pid)

    def wait_ready(self) -> dict[str, dict]:
        """Block until every child reports ready; raise RuntimeError naming the one that failed."""
        infos: dict[str, dict] = {}
        pending = dict(self.ready_conns)
        while pending:
            waitables = list(pending.values()) + [self.procs[n].sentinel for n in pending]
            multiprocessing.connection.wait(waitables)
            for name, conn in list(pending.items()):
                if conn.poll():
                    try:
                        msg = conn.recv()
                    except EOFError:
                        msg = {"ok": False, "error": "exited without reporting"}
                    if not msg["ok"]:
                        raise RuntimeError(f"the {name} process failed to start:\n{msg['error']}")
                    infos[name] = msg["info"]
                    del pending[name]
                elif not self.procs[name].is_alive():
                    raise RuntimeError(
                        f"the {name} process exited with code {self.procs[name].exitcode} before it was ready"
                    )
        return infos

    def dead(self) -> str | None:
        """A line naming the first child that is no longer running, or None."""
        for name, proc in self.procs.items():
            if not proc.is_alive():
                code = proc.exitcode
                why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                return f"the {name} process (pid {proc.pid}) died ({why})"
        return None

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 5.0
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def launch_server(server_args: ServerArgs) -> int:
    """Run the server until SIGINT/SIGTERM (returns 0) or a child dies (returns 1)."""
    import uvicorn

    from strand.runtime.process_utils import configure_logging
    from strand.runtime.tokenizer import load_tokenizer
    from strand.runtime.tokenizer_manager import TokenizerManager

    configure_logging(server_args.log_level, "server")

    def on_term(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    children = ChildProcesses(server_args)
    exit_code = {"code": 0}
    try:
        children.start()
        tokenizer = load_tokenizer(server_args.tokenizer_path or server_args.model_path)
        try:
            infos = children.wait_ready()
        except RuntimeError as e:
            logger.error("%s", e)
            return 1
        tm = TokenizerManager(server_args, tokenizer, infos["scheduler"],
                              children.paths["scheduler"], children.paths["tokenizer"])
        server: uvicorn.Server | None = None

        async def watch():
            while server is None or not server.started:
                await asyncio.sleep(0.05)
            logger.info("ready: serving %s at http://%s:%d", tm.served_model_name, server_args.host, server_args.port)
            while True:
                reason = children.dead()
                if reason:
                    logger.error("%s; shutting down", reason)
                    tm.fail_all(reason)
                    exit_code["code"] = 1
                    server.should_exit = True
                    return
                await asyncio.sleep(_CHILD_POLL_S)

        app = create_app(tm, on_ready=watch)
        config = uvicorn.Config(
            app, host=server_args.host, port=server_args.port, loop="uvloop", log_level="warning",
            timeout_keep_alive=5, timeout_graceful_shutdown=5,
        )
        server = uvicorn.Server(config)
        server.run()
        if not server.started and exit_code["code"] == 0:
            logger.error("the HTTP server did not start (is port %d in use?)", server_args.port)
            exit_code["code"] = 1
        return exit_code["code"]
    except KeyboardInterrupt:
        return exit_code["code"]
    except SystemExit as e:  # our SIGTERM handler (0), or uvicorn failing to bind (1)
        return exit_code["code"] or (e.code if isinstance(e.code, int) else 1)
    finally:
        logger.info("shutting down the child processes")
        children.stop()
        logging.shutdown()


def prepare_server_args(argv: list[str] | None = None) -> ServerArgs:
    import argparse

    parser = argparse.ArgumentParser(
        prog="strand-server",
        description="Serve a model over HTTP: SGLang's native API (/generate, ...) and the OpenAI API (/v1/...).",
    )
    ServerArgs.add_cli_args(parser)
    try:
        return ServerArgs.from_cli_args(parser.parse_args(argv))
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable


def main(argv: list[str] | None = None) -> None:
    sys.exit(launch_server(prepare_server_args(argv)))
