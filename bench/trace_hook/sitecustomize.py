"""Latency trace hook for bench/latency_trace.py (on demand, never in production).

Loaded by every Python process that has this directory on PYTHONPATH; it does
nothing unless CALLGATE_TRACE_DIR is set. Then it wraps, in that process:
AIOKafkaClient.send (one line per request: API, start, end, error code),
AIOKafkaConsumer.getmany (when a batch was returned) and
TransactionalStage._commit (the same protocol as callgate.kafka, with a
timestamp after each step and the input ranges and output offsets), writing
JSON lines to CALLGATE_TRACE_DIR/<pid>.jsonl. Clock: time.perf_counter
(CLOCK_MONOTONIC, comparable across processes on one host).
"""

import os

if os.environ.get("CALLGATE_TRACE_DIR"):
    import contextlib
    import json
    import time

    _out = open(os.path.join(os.environ["CALLGATE_TRACE_DIR"], f"{os.getpid()}.jsonl"), "w", buffering=1)  # noqa: SIM115

    def _emit(**fields):
        _out.write(json.dumps(fields) + "\n")

    def _install():
        import callgate.kafka as ck
        from aiokafka.client import AIOKafkaClient

        original_send = AIOKafkaClient.send

        async def send(self, node_id, request, *args, **kwargs):
            started = time.perf_counter()
            response = await original_send(self, node_id, request, *args, **kwargs)
            error = getattr(response, "error_code", None)
            if error is None and type(request).__name__.startswith("AddPartitionsToTxn"):
                with contextlib.suppress(Exception):
                    error = response.errors[0][1][0][1]
            _emit(k="req", c=id(self), api=type(request).__name__, t0=started, t1=time.perf_counter(), err=error)
            return response

        AIOKafkaClient.send = send

        original_getmany = ck.AIOKafkaConsumer.getmany

        async def getmany(self, *args, **kwargs):
            started = time.perf_counter()
            batch = await original_getmany(self, *args, **kwargs)
            self._trace_fetched = time.perf_counter()
            if batch:
                _emit(k="getmany", t0=started, t1=self._trace_fetched, n=sum(len(v) for v in batch.values()))
            return batch

        ck.AIOKafkaConsumer.getmany = getmany

        async def _commit(self, owned, outputs, advanced):  # callgate.kafka's protocol, with timestamps
            producer = owned.producer
            trace = {"k": "txn", "g": self.group_id, "c": id(producer.client), "n_out": len(outputs),
                     "t_fetch": getattr(self._consumer, "_trace_fetched", None), "t_start": time.perf_counter(),
                     "in": {f"{tp.topic}:{tp.partition}": [owned.next_offset(tp), end] for tp, end in advanced.items()}}
            metadata = owned.processor.commit_metadata()
            positions = {tp: om.offset for tp, om in owned.committed.items()} | advanced
            offsets = {tp: ck.OffsetAndMetadata(offset, metadata) for tp, offset in positions.items()}
            await producer.begin_transaction()
            trace["t_begin"] = time.perf_counter()
            try:
                if offsets:
                    await producer.send_offsets_to_transaction(offsets, self.group_id)
                trace["t_offsets"] = time.perf_counter()
                futures = [await producer.send(o.topic, o.value, key=o.key, headers=list(o.headers) or None)
                           for o in outputs]
                trace["t_sends"] = time.perf_counter()
                await producer.commit_transaction()
                trace["t_commit"] = time.perf_counter()
            except BaseException:
                with contextlib.suppress(Exception):
                    await producer.abort_transaction()
                raise
            trace["out"] = []
            for output, future in zip(outputs, futures):
                meta = future.result()
                trace["out"].append([meta.topic, meta.partition, meta.offset, (output.key or b"").decode("ascii", "replace")])
            _emit(**trace)
            owned.committed = offsets
            self.commits += 1

        ck.TransactionalStage._commit = _commit

    _install()
