"""`tandem fetch-model --model org/name[@rev]` against the Hub stand-in (hub_standin.py: there is no
Hugging Face Hub here; huggingface_hub is pointed at the stand-in with HF_ENDPOINT). Each test runs
the real `tandem` command in a subprocess and checks what the user sees: the snapshot folder, the
files and their bytes, or the error message."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hub_standin import HubStandIn, folder_repo

from tandem.worker.model.hub import HubError, HubModel, parse_model
from tandem.worker.server.ports import free_port

from .conftest import EXTRA_FILES, GOOD_TOKEN, OTHER_TOKEN, fetch, hub_env

pytestmark = pytest.mark.slow  # each test runs `tandem` in subprocesses (2-3 s to start each)

ENGINE_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_downloads_only_what_the_engine_reads(hub: HubStandIn, tiny_folder: Path, tmp_path: Path) -> None:
    run = fetch("org/tiny", hub_env(hub.url, tmp_path / "hf"))
    assert run.returncode == 0, run.stderr
    folder = Path(run.stdout.strip().splitlines()[-1])
    assert folder.is_relative_to(tmp_path / "hf" / "hub")  # the standard cache under HF_HOME
    assert folder.name == hub.repos["org/tiny"].sha
    assert _files(folder) == _files(tiny_folder)
    assert set(_files(folder)) == ENGINE_FILES
    for name in EXTRA_FILES:
        assert not hub.gets(name), f"{name} was downloaded"
    assert f"Hub model org/tiny: downloading from {hub.url} into {tmp_path / 'hf' / 'hub'}" in run.stderr
    assert "Fetching 1 files: 100%" in run.stderr  # huggingface_hub's progress bar (the weights)

    again = fetch("org/tiny", hub_env(hub.url, tmp_path / "hf"))  # nothing downloaded twice
    assert again.returncode == 0 and again.stdout == run.stdout
    assert len(hub.gets("model.safetensors")) == 1


def test_revision_tag_and_missing_revision(hub: HubStandIn, tmp_path: Path) -> None:
    tagged = fetch("org/tiny@v1", hub_env(hub.url, tmp_path / "hf"))
    assert tagged.returncode == 0, tagged.stderr
    assert Path(tagged.stdout.strip()).name == hub.repos["org/tiny"].sha

    missing = fetch("org/tiny@no-such-branch", hub_env(hub.url, tmp_path / "hf"))
    assert missing.returncode == 1
    assert "org/tiny has no revision 'no-such-branch' (a branch, tag or commit hash)" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_missing_repository(hub: HubStandIn, tmp_path: Path) -> None:
    run = fetch("org/no-such-model", hub_env(hub.url, tmp_path / "hf"))
    assert run.returncode == 1
    assert f"no model repository org/no-such-model on {hub.url}" in run.stderr
    assert "set HF_TOKEN" in run.stderr  # private and gated repos look missing to strangers


def test_gated_repository_needs_a_token_with_access(hub: HubStandIn, tiny_folder: Path, tmp_path: Path) -> None:
    no_token = fetch("org/gated", hub_env(hub.url, tmp_path / "hf"))
    assert no_token.returncode == 1
    assert "org/gated is a gated repository and no token was sent (HTTP 401)" in no_token.stderr
    assert "set HF_TOKEN" in no_token.stderr

    no_access = fetch("org/gated", hub_env(hub.url, tmp_path / "hf", HF_TOKEN=OTHER_TOKEN))
    assert no_access.returncode == 1
    assert "org/gated is a gated repository and the Hub refused this token (HTTP 403)" in no_access.stderr

    unknown = fetch("org/gated", hub_env(hub.url, tmp_path / "hf", HF_TOKEN="hf_not_a_real_token"))
    assert unknown.returncode == 1
    assert "the Hub refused the token for org/gated (HTTP 401" in unknown.stderr and "HF_TOKEN" in unknown.stderr
    assert "hf_not_a_real_token" not in unknown.stderr  # a token is never printed

    granted = fetch("org/gated", hub_env(hub.url, tmp_path / "hf", HF_TOKEN=GOOD_TOKEN))
    assert granted.returncode == 0, granted.stderr
    assert _files(Path(granted.stdout.strip())) == _files(tiny_folder)
    assert all(e.auth for e in hub.gets("model.safetensors"))


def test_repository_without_safetensors_is_refused_before_the_weights(hub: HubStandIn, tmp_path: Path) -> None:
    run = fetch("org/bin-only", hub_env(hub.url, tmp_path / "hf"))
    assert run.returncode == 1
    assert "org/bin-only has no *.safetensors weights at its top level (it has pytorch_model.bin)" in run.stderr
    assert not hub.gets("pytorch_model.bin")


def test_dropped_connection_resumes_where_it_broke(tiny_folder: Path, tmp_path: Path) -> None:
    """The connection drops halfway through the weights once: the same run asks for the rest with a Range
    request and the file is whole. huggingface_hub writes 10 MiB chunks, so the weights must be over 20 MiB
    for the cut to land after a written chunk."""
    from tandem.worker.model.tiny import write_tiny_model

    wide = write_tiny_model(tmp_path / "wide", hidden_size=768, intermediate_size=1536, num_hidden_layers=2)
    weights = (wide / "model.safetensors").read_bytes()
    assert len(weights) > 20 << 20
    with HubStandIn() as hub:
        hub.repos["org/wide"] = folder_repo(wide)
        hub.drop_once.add("model.safetensors")
        run = fetch("org/wide", hub_env(hub.url, tmp_path / "hf"))
        assert run.returncode == 0, run.stderr
        gets = hub.gets("model.safetensors")
    assert [g.range is None for g in gets] == [True, False]
    resumed_at = int(gets[1].range.removeprefix("bytes=").removesuffix("-"))  # type: ignore[union-attr]
    assert 0 < resumed_at <= len(weights) // 2
    got = (Path(run.stdout.strip()) / "model.safetensors").read_bytes()
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(weights).hexdigest()


def test_failed_run_keeps_finished_files(hub: HubStandIn, tiny_folder: Path, tmp_path: Path) -> None:
    """A run that fails on the weights (HTTP 500) keeps the files it finished; the next run fetches the rest."""
    hub.fail_once.add("model.safetensors")
    env = hub_env(hub.url, tmp_path / "hf")
    first = fetch("org/tiny", env)
    assert first.returncode == 1
    assert "500" in first.stderr and "org/tiny" in first.stderr
    second = fetch("org/tiny", env)
    assert second.returncode == 0, second.stderr
    assert _files(Path(second.stdout.strip())) == _files(tiny_folder)
    assert len(hub.gets("config.json")) == 1 and len(hub.gets("tokenizer.json")) == 1
    assert len(hub.gets("model.safetensors")) == 2


def test_offline_uses_a_warm_cache_and_explains_a_cold_one(hub: HubStandIn, tiny_folder: Path, tmp_path: Path) -> None:
    warm = fetch("org/tiny", hub_env(hub.url, tmp_path / "hf"))
    assert warm.returncode == 0, warm.stderr
    unreachable = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for endpoint in (hub.url, unreachable):
        asked = len(hub.log)
        offline = fetch("org/tiny", hub_env(endpoint, tmp_path / "hf", HF_HUB_OFFLINE="1"))
        assert offline.returncode == 0, offline.stderr
        assert offline.stdout == warm.stdout
        assert len(hub.log) == asked  # not one request
    down = fetch("org/tiny", hub_env(unreachable, tmp_path / "hf"))  # not offline, but the Hub is unreachable
    assert down.returncode == 0, down.stderr
    assert down.stdout == warm.stdout
    tagged = fetch("org/tiny@v1", hub_env(hub.url, tmp_path / "hf", HF_HUB_OFFLINE="1"))
    assert tagged.returncode == 1  # the tag was never downloaded: not in the cache's refs
    cold = fetch("org/tiny", hub_env(hub.url, tmp_path / "cold", HF_HUB_OFFLINE="1"))
    assert cold.returncode == 1
    assert f"HF_HUB_OFFLINE is set and org/tiny is not in the cache {tmp_path / 'cold' / 'hub'}" in cold.stderr


def test_network_down_names_the_endpoint(tmp_path: Path) -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"
    run = fetch("org/tiny", hub_env(unreachable, tmp_path / "hf"))
    assert run.returncode == 1
    assert f"cannot reach the Hub at {unreachable}" in run.stderr
    assert "HF_ENDPOINT" in run.stderr and "HF_HUB_OFFLINE=1" in run.stderr


def test_model_argument_local_folder_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_model("org/tiny") == HubModel("org/tiny")
    assert parse_model("org/tiny@v1") == HubModel("org/tiny", "v1")
    assert parse_model("org/tiny@refs/pr/1") == HubModel("org/tiny", "refs/pr/1")
    assert parse_model("hf://gpt2") == HubModel("gpt2")
    assert parse_model("tiny-llama") == Path("tiny-llama")  # no org: a folder (use hf:// for such repos)
    assert parse_model("./org/tiny") == Path("org/tiny")
    assert parse_model("/models/org/tiny") == Path("/models/org/tiny")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert parse_model("org/tiny") == Path("org/tiny")  # an existing folder wins over the Hub
    assert parse_model("hf://org/tiny") == HubModel("org/tiny")  # hf:// forces the Hub
    for bad in ("hf://", "hf://org/../x", "hf://org/tiny@", "hf://a/b/c"):
        with pytest.raises(HubError, match="not a Hugging Face repository id"):
            parse_model(bad)


def test_sharded_checkpoint_downloads_the_index_shards_only(tiny_folder: Path, tmp_path: Path) -> None:
    """An index and its two shards are downloaded; a consolidated copy beside them is not. The engine loads
    the result into the same weights as the one-file model."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_folder / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for p in tiny_folder.iterdir():
        if p.name != "model.safetensors":
            (sharded / p.name).write_bytes(p.read_bytes())
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / shard))
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    (sharded / "consolidated.safetensors").write_bytes((tiny_folder / "model.safetensors").read_bytes())
    with HubStandIn() as hub:
        hub.repos["org/sharded"] = folder_repo(sharded)
        run = fetch("org/sharded", hub_env(hub.url, tmp_path / "hf"))
        assert run.returncode == 0, run.stderr
        assert not hub.gets("consolidated.safetensors")
    folder = Path(run.stdout.strip())
    assert set(_files(folder)) == (ENGINE_FILES - {"model.safetensors"}) | set(shards) | {
        "model.safetensors.index.json"}

    from tandem.worker.model.loader import load_model

    model = load_model(folder)
    reference = load_model(tiny_folder)
    import torch

    for (name, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(reference.state_dict().items()), strict=True):
        assert torch.equal(a, b), name


def test_concurrent_fetches_into_one_cache_download_once(hub: HubStandIn, tiny_folder: Path, tmp_path: Path) -> None:
    """Three fetches into one cache at once (worker pods sharing a cache volume): the weights are downloaded
    once, the others wait for the lock and then find the files; each links its own --link to the snapshot."""
    hub.slow["model.safetensors"] = 3.0
    env = hub_env(hub.url, tmp_path / "hf")
    runs = [subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "fetch-model", "--model", "org/tiny",
                              "--link", str(tmp_path / f"pod{i}" / "model")], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(3)]
    outs = [r.communicate(timeout=120) for r in runs]
    assert [r.returncode for r in runs] == [0, 0, 0], outs
    assert len(hub.gets("model.safetensors")) == 1
    assert sum("another download of org/tiny" in err and "waiting for it" in err for _, err in outs) == 2
    snapshot = Path(outs[0][0].strip())
    for i in range(3):
        link = tmp_path / f"pod{i}" / "model"
        assert link.is_symlink() and link.resolve() == snapshot.resolve()
        assert _files(link) == _files(tiny_folder)


def test_the_operator_init_container_command_fetches_a_gated_model(hub: HubStandIn, tiny_folder: Path,
                                                                   tmp_path: Path) -> None:
    """The init container the operator builds for a huggingFace source (its args and env, with /models and /tmp
    moved under tmp_path and the Secret's value filled in), run for real: the link it leaves is a model folder
    that `tandem worker --model LINK` reads as a plain folder."""
    from tandem.operator import builders
    from tandem.operator.api import DisaggregatedModelSpec

    spec = DisaggregatedModelSpec.model_validate({"model": {"name": "m", "source": {"huggingFace": {
        "repo": "org/gated", "revision": "main", "tokenSecretRef": {"name": "hf"}, "cache": {"claimName": "c"}}}}})
    init = builders.fetch_model_container(spec, "decode")
    moved = {builders.MODEL_MOUNT: str(tmp_path / "claim"), "/tmp": str(tmp_path / "pod-tmp")}

    def move(value: str) -> str:
        for old, new in moved.items():
            if value == old or value.startswith(old + "/"):
                return new + value[len(old):]
        return value

    env = hub_env(hub.url, tmp_path / "unused-home")
    for var in init["env"]:
        env[var["name"]] = move(var["value"]) if "value" in var else GOOD_TOKEN  # the Secret's value
    run = subprocess.run([sys.executable, "-m", "tandem.worker.cli", *[move(a) for a in init["args"]]],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    link = Path(move(builders.HUB_MODEL_LINK))
    assert link.is_symlink() and _files(link) == _files(tiny_folder)
    assert link.resolve().is_relative_to((tmp_path / "claim").resolve())  # the cache is the claim's root
    assert parse_model(str(link)) == link  # the worker's --model: a folder, no Hub lookup
