"""Settings from CALLGATE_* environment variables; secrets never shown."""

from __future__ import annotations

import pickle
import secrets
import traceback

import pytest
from pydantic import ValidationError

from callgate.settings import REPO_ROOT, DataHandling, Settings
from callgate.topics import TopicNames

KEY_HEX = secrets.token_hex(32)


def test_defaults_without_any_environment():
    settings = Settings.from_env({})
    assert settings.kafka_bootstrap == "127.0.0.1:19092"
    assert settings.topics == TopicNames("callgate") and settings.partitions == 6
    assert settings.data_handling is DataHandling.DROP
    assert settings.audit_hmac_key is None and settings.metrics_port is None
    assert settings.signing_key_map() == {}
    assert settings.tools_dir == REPO_ROOT / "schemas" / "tools" and settings.tools_dir.is_dir()
    assert settings.policies_dir == REPO_ROOT / "policies"


def test_settings_from_env():
    settings = Settings.from_env(
        {
            "CALLGATE_KAFKA_BOOTSTRAP": "127.0.0.1:1",
            "CALLGATE_TOPIC_NAMESPACE": "demo",
            "CALLGATE_PARTITIONS": "3",
            "CALLGATE_SIGNING_KEYS": "k1:00ff, k2:abcd",
            "CALLGATE_SIGNING_KEY_ID": "k2",
            "CALLGATE_DATA_HANDLING": "keep",
            "CALLGATE_METRICS_PORT": "9464",
            "CALLGATE_TOOLS_DIR": "/tmp/tools",
            "CALLGATE_METRICS": "ignored: not a setting",
            "KAFKA_BOOTSTRAP": "ignored: no prefix",
        }
    )
    assert settings.kafka_bootstrap == "127.0.0.1:1"
    assert settings.topics.items == "demo.items" and settings.partitions == 3
    assert settings.signing_key() == bytes.fromhex("abcd")
    assert settings.signing_key_map() == {"k1": b"\x00\xff", "k2": b"\xab\xcd"}
    assert settings.data_handling is DataHandling.KEEP
    assert settings.metrics_port == 9464 and str(settings.tools_dir) == "/tmp/tools"


def test_an_empty_variable_means_the_default():
    assert Settings.from_env({"CALLGATE_METRICS_PORT": "", "CALLGATE_PARTITIONS": ""}).partitions == 6


@pytest.mark.parametrize(
    "env",
    [
        {"CALLGATE_DATA_HANDLING": "sometimes"},
        {"CALLGATE_PARTITIONS": "0"},
        {"CALLGATE_METRICS_PORT": "http"},
    ],
)
def test_bad_values_fail_at_startup(env):
    with pytest.raises(ValidationError):
        Settings.from_env(env)


def test_secrets_never_show_in_repr_dump_or_pickle_free_text():
    settings = Settings.from_env(
        {"CALLGATE_SIGNING_KEYS": f"k1:{KEY_HEX}", "CALLGATE_SIGNING_KEY_ID": "k1",
         "CALLGATE_AUDIT_HMAC_KEY": "audit-canary-secret"}
    )
    for text in (repr(settings), str(settings), settings.model_dump_json(), str(settings.model_dump())):
        assert KEY_HEX not in text and "audit-canary-secret" not in text
    assert settings.signing_key() == bytes.fromhex(KEY_HEX)
    assert settings.audit_hmac_key.get_secret_value() == "audit-canary-secret"
    assert pickle.loads(pickle.dumps(settings)) == settings  # worker processes can receive it


@pytest.mark.parametrize(
    "keys",
    [
        f"k1{KEY_HEX}",  # no colon
        f"k1:{KEY_HEX}zz",  # not hex
        f":{KEY_HEX}",  # no key id
        f"k1:{KEY_HEX},k1:{KEY_HEX}",  # the same id twice
    ],
    ids=["no-colon", "not-hex", "no-id", "repeated-id"],
)
def test_malformed_signing_keys_fail_at_startup_without_echoing_the_key(keys):
    with pytest.raises(ValidationError) as caught:
        Settings.from_env({"CALLGATE_SIGNING_KEYS": keys})
    printed = "".join(traceback.format_exception(caught.value))
    assert "CALLGATE_SIGNING_KEYS entry" in printed
    # pydantic shortens long inputs in the middle, so look for either end of the key
    assert KEY_HEX[:10] not in printed and KEY_HEX[-10:-2] not in printed


def test_an_unknown_active_key_id_is_an_error_naming_only_the_id():
    settings = Settings.from_env({"CALLGATE_SIGNING_KEYS": f"k1:{KEY_HEX}", "CALLGATE_SIGNING_KEY_ID": "k9"})
    with pytest.raises(ValueError, match="k9") as caught:
        settings.signing_key()
    assert KEY_HEX not in str(caught.value)
