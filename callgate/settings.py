"""Settings shared by every worker, read from CALLGATE_* environment variables.

Secrets are SecretStr so a repr, a log line or a traceback never shows them,
and validation errors never echo an input (a bad CALLGATE_SIGNING_KEYS must
not print the key in the startup traceback).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from callgate.topics import TopicNames

REPO_ROOT = Path(__file__).resolve().parent.parent


class DataHandling(StrEnum):
    DROP = "drop"  # quarantined raw buffers are discarded (the default)
    KEEP = "keep"  # kept, on a restricted topic only


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, hide_input_in_errors=True)

    kafka_bootstrap: str = "127.0.0.1:19092"
    topic_namespace: str = "callgate"
    partitions: int = Field(default=6, ge=1)
    # "kid:hexkey,kid2:hexkey": every key an executor accepts; the validator signs with signing_key_id
    signing_keys: SecretStr = SecretStr("")
    signing_key_id: str = "dev"
    audit_hmac_key: SecretStr | None = None  # enables content correlation in audit records
    data_handling: DataHandling = DataHandling.DROP
    tools_dir: Path = REPO_ROOT / "schemas" / "tools"
    policies_dir: Path = REPO_ROOT / "policies"
    approval_ttl_s: int = Field(default=900, ge=1)  # unanswered approval requests expire (validator)
    run_state_ttl_s: int = Field(default=6 * 3600, ge=60)  # validator keeps per-run call counts this long after a run's last item
    run_idle_deadline_s: float = Field(default=120.0, gt=0)  # normalizer: an open attempt silent this long is quarantined
    max_item_bytes: int = Field(default=4 << 20, ge=1)  # normalizer: memory cap per accumulated item
    metrics_port: int | None = None
    worker_id: str = Field(default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}")

    @field_validator("signing_keys")
    @classmethod
    def _keys_parse(cls, value: SecretStr) -> SecretStr:
        _parse_signing_keys(value.get_secret_value())  # fail at startup, not at the first signature
        return value

    @property
    def topics(self) -> TopicNames:
        return TopicNames(self.topic_namespace)

    def signing_key_map(self) -> dict[str, bytes]:
        return _parse_signing_keys(self.signing_keys.get_secret_value())

    def signing_key(self) -> bytes:
        keys = self.signing_key_map()
        if self.signing_key_id not in keys:
            raise ValueError(f"no signing key with id {self.signing_key_id!r} in CALLGATE_SIGNING_KEYS")
        return keys[self.signing_key_id]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        fields = {}
        for name in cls.model_fields:
            value = env.get(f"CALLGATE_{name.upper()}")
            if value is not None and value != "":
                fields[name] = value
        return cls(**fields)


def _parse_signing_keys(text: str) -> dict[str, bytes]:
    """`kid:hexkey,kid2:hexkey` -> {kid: key}. Errors name the entry's position, never a key."""
    keys: dict[str, bytes] = {}
    for position, entry in enumerate(filter(None, (e.strip() for e in text.split(","))), start=1):
        kid, _, hexkey = entry.partition(":")
        kid, hexkey = kid.strip(), hexkey.strip()
        if not kid or not hexkey:
            raise ValueError(f"CALLGATE_SIGNING_KEYS entry {position} is not kid:hexkey")
        try:
            key = bytes.fromhex(hexkey)
        except ValueError:
            raise ValueError(f"CALLGATE_SIGNING_KEYS entry {position} is not hex") from None
        if kid in keys:
            raise ValueError(f"CALLGATE_SIGNING_KEYS entry {position} repeats a key id")
        keys[kid] = key
    return keys
