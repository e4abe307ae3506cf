"""The scheduler's process: the model, the KV pool and the iteration loop behind a ZMQ socket."""

from __future__ import annotations

import logging

from strand.runtime.detokenizer import DetokenizeSpec
from strand.runtime.io_struct import (
    AbortReq,
    BatchReqOutput,
    ControlOut,
    ControlReq,
    ReqOutput,
    TokenizedGenerateReq,
)

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000


def scheduler_info(scheduler) -> dict:
    """What the tokenizer manager needs to know about the loaded model."""
    cfg = scheduler.model_config
    return {
        "model_path": scheduler.model_path,
        "context_length": int(scheduler.context_length),
        "max_total_tokens": int(scheduler.max_total_tokens),
        "vocab_size": getattr(cfg, "vocab_size", None),
        "eos_token_ids": list(getattr(cfg, "eos_token_ids", []) or []),
    }


class SchedulerLoop:
    """Moves messages between the sockets and the Scheduler; one `run_once` per iteration."""

    def __init__(self, scheduler, recv, send_detok, send_tm):
        self.scheduler = scheduler
        self.recv = recv
        self.send_detok = send_detok
        self.send_tm = send_tm

    def dispatch(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            # Same socket as the outputs, so the detokenizer learns the spec before any output.
            self.send_detok.send_pyobj(DetokenizeSpec.from_req(msg))
            try:
                self.scheduler.add_request(msg)
            except Exception as e:  # the contract says it never raises; keep serving if it does
                logger.exception("scheduler: add_request(%s) failed", msg.rid)
                self.send_detok.send_pyobj(BatchReqOutput([ReqOutput(
                    rid=msg.rid, new_token_ids=[], prompt_tokens=len(msg.input_ids),
                    finish_reason={"type": "abort", "message": f"{type(e).__name__}: {e}", "status_code": 500},
                )]))
        elif isinstance(msg, AbortReq):
            self.scheduler.abort_request(msg.rid)
        elif isinstance(msg, ControlReq):
            self.send_tm.send_pyobj(self.control(msg))
        else:
            logger.error("scheduler: unexpected message %r", type(msg).__name__)

    def control(self, req: ControlReq) -> ControlOut:
        if req.kind == "flush_cache":
            ok, message = self.scheduler.flush_cache()
            return ControlOut(cid=req.cid, ok=ok, payload={"message": message})
        if req.kind == "get_stats":
            return ControlOut(cid=req.cid, ok=True, payload=dict(self.scheduler.get_stats()))
        return ControlOut(cid=req.cid, ok=False, payload={"message": f"unknown control {req.kind!r}"})

    def run_once(self) -> None:
        import zmq

        # Drain everything waiting without blocking while there is work; block when idle.
        timeout = 0 if self.scheduler.has_work() else _IDLE_POLL_MS
        while self.recv.poll(timeout, zmq.POLLIN):
            self.dispatch(self.recv.recv_pyobj(zmq.NOBLOCK))
            timeout = 0
        outputs = self.scheduler.step()
        if outputs:
            self.send_detok.send_pyobj(BatchReqOutput(outputs))


def run_scheduler_process(server_args, recv_path: str, detok_path: str, tm_path: str, ready_conn) -> None:
    """Child process: build the Scheduler, report ready (or the load error), then loop forever.

    PULL requests at `recv_path`; PUSH outputs to the detokenizer at `detok_path` and control
    answers to the tokenizer manager at `tm_path`.
    """
    from strand.runtime.process_utils import child_process_setup, report_ready

    child_process_setup("scheduler", server_args.log_level)
    import zmq

    try:
        from strand.runtime.scheduler import Scheduler

        scheduler = Scheduler(server_args)
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        recv.bind(recv_path)
        send_detok = ctx.socket(zmq.PUSH)
        send_detok.connect(detok_path)
        send_tm = ctx.socket(zmq.PUSH)
        send_tm.connect(tm_path)
        info = scheduler_info(scheduler)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which shuts down
        report_ready(ready_conn, error=e)
        return
    report_ready(ready_conn, info=info)
    loop = SchedulerLoop(scheduler, recv, send_detok, send_tm)
    try:
        while True:
            loop.run_once()
    except BaseException as e:
        logger.exception("scheduler: crashed: %s: %s", type(e).__name__, e)
        raise SystemExit(1) from None
