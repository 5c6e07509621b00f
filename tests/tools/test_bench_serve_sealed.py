"""The serve part's ``sealed`` configuration: pykvcache's defaults with every
chunk sealed under a key made beside the server's store, which the product's
own check accepts, and which a server restarted on that store gets again."""

from __future__ import annotations

import stat

from pykvcache import _core
from pykvcache.tools.bench.serve_options import SEALED, ServeOptions
from pykvcache.tools.bench.serve_run import server_config

BPT = 32 * 1024


def test_only_the_sealed_servers_get_a_key_that_the_store_accepts(tmp_path):
    opts = ServeOptions(configs=["recompute", "pykvcache", SEALED])
    assert opts.check() == []
    theirs = server_config(SEALED, "m", opts, BPT, tmp_path / "sealed-0" / "kv")
    ours = server_config("pykvcache", "m", opts, BPT, tmp_path / "pykvcache-0" / "kv")
    extra = dict(theirs.kv_transfer_config["kv_connector_extra_config"])
    key = extra.pop("encryption_key_file")
    extra["storage_dirs"] = ours.kv_transfer_config["kv_connector_extra_config"]["storage_dirs"]
    assert extra == ours.kv_transfer_config["kv_connector_extra_config"] and theirs.args == ours.args
    mode = (tmp_path / "sealed-0" / "serve-encryption.key").stat().st_mode
    assert key == str(tmp_path / "sealed-0" / "serve-encryption.key") and stat.S_IMODE(mode) == 0o600
    assert _core.check_key_file(key)  # what the vLLM spec checks before the model loads


def test_a_server_started_again_on_the_same_store_gets_the_same_key(tmp_path):
    opts = ServeOptions(configs=[SEALED])
    first = server_config(SEALED, "m", opts, BPT, tmp_path / "kv").kv_transfer_config["kv_connector_extra_config"]
    key_bytes = open(first["encryption_key_file"], "rb").read()
    again = server_config(SEALED, "m", opts, BPT, tmp_path / "kv").kv_transfer_config["kv_connector_extra_config"]
    assert again["encryption_key_file"] == first["encryption_key_file"]
    assert open(again["encryption_key_file"], "rb").read() == key_bytes and len(key_bytes) == 32
