"""A real single-node Apache Kafka broker (KRaft), assembled from Maven Central.

No Docker engine runs on our machines, so `dev/kafka`, the test fixture and the
demo start Kafka from its jars: Maven copies the classpath of
`org.apache.kafka:kafka_2.13` (see dev/kafka-libs/pom.xml) into a cache outside
the repository, the storage tool formats a state directory, and `kafka.Kafka`
runs broker and controller in one JVM on 127.0.0.1.

The state directory holds `server.properties`, the logs, `broker.pid` and
`broker.json` (the address), so a second `up` finds and reuses a running broker.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
import base64
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
POM = REPO_ROOT / "dev" / "kafka-libs" / "pom.xml"
KAFKA_VERSION = "4.4.0"
CACHE_DIR = Path(os.environ.get("CALLGATE_CACHE_DIR", Path.home() / ".cache" / "callgate"))
# keyed by the pom's content, so editing a version fetches a fresh classpath
_POM_DIGEST = hashlib.sha256(POM.read_bytes()).hexdigest()[:10] if POM.exists() else "nopom"
LIBS_DIR = Path(os.environ.get("CALLGATE_KAFKA_LIBS", CACHE_DIR / f"kafka-libs-{KAFKA_VERSION}-{_POM_DIGEST}"))
DEFAULT_STATE_DIR = Path(os.environ.get("CALLGATE_KAFKA_STATE", REPO_ROOT / "var" / "kafka"))
DEFAULT_PORT = 19092

# Trimmed for a 2-core machine: the broker only serves tests and demos here.
JVM_FLAGS = (
    "-Xms256m",
    "-Xmx768m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-Djava.awt.headless=true",
)

LOG4J2 = """\
status = WARN
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
logger.request.name = kafka.request.logger
logger.request.level = WARN
"""

SERVER_PROPERTIES = """\
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{controller_port}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs={data}
offsets.topic.replication.factor=1
offsets.topic.num.partitions=3
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=3
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
default.replication.factor=1
min.insync.replicas=1
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
transaction.abort.timed.out.transaction.cleanup.interval.ms=5000
transaction.remove.expired.transaction.cleanup.interval.ms=30000
auto.create.topics.enable=false
num.partitions=1
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.cleaner.dedupe.buffer.size=16777216
log.retention.check.interval.ms=60000
"""


class BrokerError(RuntimeError):
    """The local broker could not be assembled, started or reached."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def ensure_libs(libs_dir: Path = LIBS_DIR) -> Path:
    """Fetch the broker classpath with Maven once; later calls only check the cache."""
    marker = libs_dir / ".complete"
    if marker.exists():
        return libs_dir
    if shutil.which("mvn") is None:
        raise BrokerError("mvn is not on PATH: it is needed once to fetch the Kafka jars")
    libs_dir.mkdir(parents=True, exist_ok=True)
    fetched = subprocess.run(
        [
            "mvn", "-B", "-q", "-Dstyle.color=never", "-f", str(POM), "dependency:copy-dependencies",
            "-DincludeScope=runtime", f"-DoutputDirectory={libs_dir}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if fetched.returncode != 0:  # quiet when it works, the whole story when it does not
        raise BrokerError(f"mvn failed ({fetched.returncode}):\n{fetched.stdout[-4000:]}{fetched.stderr[-4000:]}")
    if not any(libs_dir.glob("kafka_2.13-*.jar")):
        raise BrokerError(f"maven finished but no kafka jar is in {libs_dir}")
    marker.write_text(KAFKA_VERSION)
    return libs_dir


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise BrokerError("java is not on PATH (Java 17 or newer is needed)")
    return java


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours still answers kill(0); reap it if it is ours
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


@dataclass(slots=True)
class LocalBroker:
    state_dir: Path = DEFAULT_STATE_DIR
    port: int = DEFAULT_PORT
    libs_dir: Path = LIBS_DIR

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def _pid_file(self) -> Path:
        return self.state_dir / "broker.pid"

    @property
    def _info_file(self) -> Path:
        return self.state_dir / "broker.json"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "logs" / "server.log"

    def running_pid(self) -> int | None:
        try:
            pid = int(self._pid_file.read_text())
        except (FileNotFoundError, ValueError):
            return None
        return pid if _pid_alive(pid) else None

    @classmethod
    def existing(cls, state_dir: Path = DEFAULT_STATE_DIR) -> LocalBroker | None:
        """The broker a previous `up` left running in state_dir, if it still runs."""
        try:
            info = json.loads((state_dir / "broker.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        broker = cls(state_dir=state_dir, port=int(info["port"]))
        return broker if broker.running_pid() is not None else None

    def _write_config(self, *, keep_controller_port: bool = False) -> tuple[Path, Path]:
        props = self.state_dir / "server.properties"
        previous = props.read_text() if keep_controller_port and props.exists() else ""
        kept = [line.rsplit(":", 1)[1] for line in previous.splitlines() if line.startswith("controller.quorum.voters=")]
        # a restart on kept data keeps the controller's address: the quorum state names it
        controller_port = int(kept[0]) if kept else free_port()
        while controller_port == self.port:
            controller_port = free_port()
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        props.write_text(
            SERVER_PROPERTIES.format(
                port=self.port, controller_port=controller_port, data=self.state_dir / "data"
            )
        )
        log4j = self.state_dir / "log4j2.properties"
        log4j.write_text(LOG4J2.format(log=self.log_file))
        return props, log4j

    def start(self, *, timeout_s: float = 90.0, fresh: bool = True) -> None:
        """Format storage and start the broker; return once it answers Kafka requests.

        fresh=False keeps the data directory (topics, offsets, transactions) of a
        previous start from the same state_dir: a broker restart.
        """
        if self.running_pid() is not None:
            raise BrokerError(f"a broker already runs from {self.state_dir}")
        if _port_open(self.port):
            raise BrokerError(f"port {self.port} is taken by another process")
        libs = ensure_libs(self.libs_dir)
        if fresh and (self.state_dir / "data").exists():
            shutil.rmtree(self.state_dir / "data")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        formatted = (self.state_dir / "data" / "meta.properties").exists()
        props, log4j = self._write_config(keep_controller_port=formatted)
        classpath = f"{libs}/*"
        log_opt = f"-Dlog4j2.configurationFile={log4j}"
        java = _java()
        if not formatted:  # kept data (fresh=False) is already formatted with its own cluster id
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
            subprocess.run(
                [java, "-Xmx256m", "-XX:TieredStopAtLevel=1", log_opt, "-cp", classpath,
                 "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props), "--ignore-formatted"],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        console = open(self.state_dir / "logs" / "console.log", "ab")
        process = subprocess.Popen(
            [java, *JVM_FLAGS, log_opt, f"-Dkafka.logs.dir={self.state_dir / 'logs'}",
             "-cp", classpath, "kafka.Kafka", str(props)],
            stdout=console,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives the shell that ran `dev/kafka up`
        )
        console.close()
        self._pid_file.write_text(str(process.pid))
        self._info_file.write_text(json.dumps({"port": self.port, "pid": process.pid}))
        try:
            self.wait_ready(timeout_s=timeout_s, process=process)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, *, timeout_s: float = 90.0, process: subprocess.Popen | None = None) -> None:
        """Wait until the broker answers a metadata request from a real Kafka client."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise BrokerError(f"broker exited with {process.returncode}; see {self.log_file}")
            if _port_open(self.port) and asyncio.run(self._answers()):
                return
            time.sleep(0.25)  # polling a condition with a deadline, not a synchronising sleep
        raise BrokerError(f"broker did not answer within {timeout_s:.0f}s; see {self.log_file}")

    async def _answers(self) -> bool:
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=self.address, request_timeout_ms=3000)
        try:
            await admin.start()
            await admin.list_topics()
            return True
        except Exception:
            return False
        finally:
            await admin.close()

    def stop(self, *, timeout_s: float = 30.0) -> None:
        """SIGTERM for a clean shutdown, then SIGKILL if it will not go."""
        pid = self.running_pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pid = None
            deadline = time.monotonic() + timeout_s
            while pid is not None and _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if pid is not None and _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._pid_file.unlink(missing_ok=True)
        self._info_file.unlink(missing_ok=True)


def up(state_dir: Path = DEFAULT_STATE_DIR, port: int | None = None) -> LocalBroker:
    """Start a broker, or reuse the one already running from state_dir."""
    existing = LocalBroker.existing(state_dir)
    if existing is not None:
        existing.wait_ready(timeout_s=30)
        return existing
    broker = LocalBroker(state_dir=state_dir, port=port or int(os.environ.get("CALLGATE_KAFKA_PORT", DEFAULT_PORT)))
    broker.start()
    return broker


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="dev/kafka", description="the local Kafka broker")
    parser.add_argument("command", choices=("up", "down", "status", "address", "libs"))
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)
    if args.command == "libs":
        print(ensure_libs())
        return 0
    if args.command == "up":
        started = time.monotonic()
        broker = up(args.state_dir, args.port)
        print(f"kafka up at {broker.address} ({time.monotonic() - started:.1f}s)")
        return 0
    existing = LocalBroker.existing(args.state_dir)
    if args.command == "down":
        if existing is not None:
            existing.stop()
            print("kafka stopped")
        else:
            print("no broker running")
        return 0
    if args.command == "address":
        if existing is None:
            print("no broker running", flush=True)
            return 1
        print(existing.address)
        return 0
    print(f"running at {existing.address} (pid {existing.running_pid()})" if existing else "not running")
    return 0 if existing else 1


if __name__ == "__main__":
    raise SystemExit(main())
