"""The normalizer worker for the crash test: settings from env, small batches, a fast group."""

from __future__ import annotations

import asyncio
import signal
import sys

from callgate.settings import Settings
from normalizer.worker import run_normalizer


async def _main(max_records: int) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await run_normalizer(Settings.from_env(), stop, max_records=max_records,
                         consumer_options={"session_timeout_ms": 3000, "heartbeat_interval_ms": 500})


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1])))
