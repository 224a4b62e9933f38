"""Timeline tracing for one sync, in every process that starts with this folder on PYTHONPATH.

With ``COLOSYNC_TRACE_DIR`` set, the functions below are wrapped to record
``(label, phase, perf_counter_ns, thread)`` at entry and exit; each process writes its records
to ``$COLOSYNC_TRACE_DIR/trace-<pid>.json`` when it exits. ``perf_counter`` is CLOCK_MONOTONIC,
one clock for every process on the machine, so trainer and engine records line up.
Measurement only: nothing here is imported by colosync.
"""

import os

if os.environ.get("COLOSYNC_TRACE_DIR"):
    import atexit
    import functools
    import importlib
    import json
    import threading
    import time

    _records: list = []
    _now = time.perf_counter_ns

    def _dump() -> None:
        path = os.path.join(os.environ["COLOSYNC_TRACE_DIR"], f"trace-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(_records, f)

    atexit.register(_dump)

    def _wrap(owner, name, label, detail=None):
        import inspect

        static = isinstance(inspect.getattr_static(owner, name), staticmethod)
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            tag = label + (detail(*args, **kwargs) if detail else "")
            tid = threading.get_ident() & 0xFFFF
            _records.append((tag, "B", _now(), tid))
            try:
                return fn(*args, **kwargs)
            finally:
                _records.append((tag, "E", _now(), tid))

        setattr(owner, name, staticmethod(wrapper) if static else wrapper)

    def _type_of(index):
        return lambda *a, **k: ":" + type(a[index]).__name__

    def install() -> None:
        m = importlib.import_module
        sender = m("colosync.sync.sender")
        pipeline = m("colosync.sync.pipeline")
        plan = m("colosync.sync.plan")
        channel = m("colosync.control.channel")
        host = m("colosync.engines.host")
        receiver = m("colosync.sync.receiver")
        landing = m("colosync.sync.landing")
        graphs = m("colosync.transports.cuda_graphs")
        cuda_ipc = m("colosync.transports.cuda_ipc")
        # trainer
        _wrap(sender.Sender, "push", "T.push")
        _wrap(plan.Plans, "get", "T.plans_get")
        _wrap(pipeline.BucketStreamer, "stream", "T.stream")
        _wrap(pipeline.BucketStreamer, "_pack_checked", "T.pack_checked")
        _wrap(pipeline.SlotPipeline, "_send", "T.send_stage")
        _wrap(pipeline.SlotPipeline, "finish", "T.finish")
        _wrap(channel.SocketLink, "submit", "T.submit", _type_of(1))
        _wrap(channel._Pending, "wait", "T.wait")
        # engine: a connection's thread reads from its socket (E is when bytes arrived), then its work
        if hasattr(channel, "_Frames"):
            _wrap(channel._Frames, "_fill", "E.recv")
        else:  # the asyncio channel before it: the loop hands a message to the engine thread
            original_init = channel.ChannelServer.__init__

            def init(self, *args, **kwargs):
                original_init(self, *args, **kwargs)
                _wrap(self._engine, "submit", "E.loop_submit")

            channel.ChannelServer.__init__ = init
        _wrap(channel, "frame", "frame")
        _wrap(host.EngineHost, "handle", "E.handle", _type_of(1))
        _wrap(receiver.Receiver, "begin", "E.begin")
        _wrap(receiver.Receiver, "stage", "E.stage")
        _wrap(receiver.Receiver, "prepare", "E.prepare")
        _wrap(receiver.Receiver, "commit", "E.commit")
        _wrap(landing.Landing, "verify", "E.verify")
        _wrap(landing.Fence, "staged", "E.fence_staged")
        _wrap(landing.Fence, "drain", "E.fence_drain")
        _wrap(graphs.GraphCache, "run", "X.graph_run")
        _wrap(cuda_ipc.CudaIpcReceiver, "ready", "E.ipc_ready")
        # finer: where the engine's Stage and Prepare spend their time, and the codecs
        protocol = m("colosync.wire.protocol")
        sink = m("colosync.engines.sink")
        torch = m("torch")
        _wrap(landing.Landing, "admit", "E.admit")
        _wrap(landing.Landing, "land", "E.land")
        _wrap(landing.Landing, "_row", "E.row")
        _wrap(landing.Landing, "_landed", "E.landed")
        _wrap(landing.Landing, "engine_tensors", "E.engine_tensors")
        _wrap(receiver, "untie", "E.untie")
        _wrap(sink.SinkEngine, "prepare", "E.sink_prepare")
        _wrap(sink.SinkEngine, "commit", "E.sink_commit")
        _wrap(host.EngineHost, "decode", "X.decode")
        _wrap(host.EngineHost, "encode", "X.encode")
        _wrap(protocol.Codec, "encode", "X.codec_encode")
        _wrap(torch.cuda.CUDAGraph, "replay", "X.cuda_graph_replay")
        _wrap(pipeline.BucketStreamer, "_gather", "T.gather_staging")
        _wrap(plan.Plans, "find", "T.plans_find")
        if hasattr(plan, "LayoutChanged"):  # the plan by names, each bucket checked
            _wrap(plan.Plans, "named", "T.plans_named")
            _wrap(plan.Plan, "check", "T.plan_check")
        if hasattr(graphs, "LayoutVersion"):  # layouts checked in one C++ pass
            _wrap(graphs.LayoutVersion, "of", "X.layout_of")
        gather = m("colosync.kernels.gather")
        _wrap(gather.GatherTable, "bind", "T.gather_bind")

    try:
        install()
    except Exception as exc:  # tracing must never stop a run
        print(f"colosync trace: not installed ({type(exc).__name__}: {exc})")
