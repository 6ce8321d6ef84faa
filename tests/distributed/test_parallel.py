"""Tensor and pipeline parallelism over mx.distributed (issue 27): 2 ranks of a ring group on 127.0.0.1
(fx_engine.testing.distributed.launch_local: mlx.launch's environment) against one process.
Each rank runs tools/tp_run.py; rank 0 reports."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.testing import write_tiny_model
from fx_engine.testing.distributed import launch_local, launch_mpi, mpirun

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RUN = [sys.executable, str(ROOT / "tools" / "tp_run.py")]


def tp(args: list[str], n: int = 2, env: dict | None = None, timeout: float = 240, split: str = "tp") -> dict:
    ranks = launch_local(n, RUN + [f"--{split}", str(n), *args], timeout=timeout, env=env)
    for r in ranks:
        assert r.returncode == 0, f"rank {r.rank}: {r.returncode}\n{r.stderr[-3000:]}"
    return json.loads(ranks[0].stdout.strip().splitlines()[-1])


def alone(args: list[str]) -> dict:
    import subprocess

    p = subprocess.run(RUN + args, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


_ALONE: dict[tuple[str, ...], dict] = {}


def alone_once(args: list[str]) -> dict:
    """`alone(args)`, run once per module for the same arguments (the tiny families' tensor
    and pipeline cases share their model and their one-process run)."""
    if tuple(args) not in _ALONE:
        _ALONE[tuple(args)] = alone(args)
    return _ALONE[tuple(args)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.mark.parametrize("split", ["tp", "pp"])
def test_default_model_two_ranks_equal_one_process(split):
    """Tensor parallel: SmolLM2's 3 KV heads split 2 + 1 (9 query heads: 6 + 3), its MLP and
    49k vocabulary halved. Pipeline parallel: 15 + 15 layers. Greedy tokens (the plain
    generate and a continuous batch of 3 rows), and the logits, as one process computes them."""
    args = ["--tokens", "24", "--logits", "--engine", "3"]
    one, two = alone(args), tp(args, split=split)
    if split == "tp":
        assert (two["heads"], two["kv_heads"]) == (6, 2)  # rank 0's share
    else:
        assert two["layers"] == 15
    assert two["tokens"] == one["tokens"] and len(one["tokens"]) == 24
    assert two["engine"] == one["engine"]
    diff = mx.abs(mx.array(two["logits"]) - mx.array(one["logits"])).max().item()
    assert diff < 2e-3, diff


FAMILY_CASES = [(k, s) for k in ("llama-q4", "qwen3", "qwen2-untied", "phi3", "starcoder2", "exaone4")
                for s in ("tp", "pp")] + [("qwen3_moe", "tp"), ("qwen3_moe", "pp"), ("qwen2_moe", "tp"),
                                          ("mixtral", "tp"), ("olmo2", "pp"), ("gemma3_text", "tp"),
                                          ("gemma2", "tp"), ("gemma4_text", "pp"), ("gemma2", "pp")]
# every family splits by layers (Family.layer_range): the recurrent ones carry their states
# per stage; Gemma 4 hands the embeddings (its per-layer inputs' source) and the K/V of a
# KV-shared layer's source on an earlier stage with the stream (6 layers: stage 1's shared
# layers attend over its own layer 3 and stage 0's layer 2)
OWN_CONFIG = ["cohere2", "deepseek_v3", "deepseek_v2", "gpt_oss", "lfm2", "lfm2_moe", "mamba2", "nemotron_h", "qwen3_next",
              "qwen3_5_moe_text", "granitemoehybrid", "falcon_h1", "gemma4_text-moe"]
FAMILY_CASES += [(k, "pp") for k in OWN_CONFIG]
# and over ranks (Family.tensor_split): Mamba-2 mixers' heads with their B/C groups (2 groups
# split; one group replicated: -g1), their gated norm per group or over every rank's
# channels; Gated DeltaNet's key heads with their value heads; LFM2's convolution channels
# (LFM2-MoE's with each expert's features)
FAMILY_CASES += [(k, "tp") for k in ("mamba2", "mamba2-g1", "mamba2-q4", "nemotron_h", "granitemoehybrid",
                                     "falcon_h1", "qwen3_next", "qwen3_5_moe_text", "lfm2", "lfm2_moe")]
# Gemma 4: per-layer head sizes, KV-shared layers (query rows only), the per-layer input
# table's vocabulary rows; global layers with fewer KV heads and keys as values; experts
FAMILY_CASES += [(k, "tp") for k in ("gemma4_text", "gemma4_text-keqv", "gemma4_text-keqv2", "gemma4_text-moe")]
# tensor parallel beyond the Llama decoder's plain layers: OLMo's q/k norms over every head
# (mean squares summed over the ranks), Cohere's parallel blocks and per-head LayerNorms,
# DeepSeek's latent attention (heads split, the latent cache replicated) with routed and
# shared experts, GPT-OSS's attention sinks and biased experts
FAMILY_CASES += [(k, "tp") for k in ("olmo2", "olmoe", "cohere2", "cohere-qknorm", "deepseek_v3", "gpt_oss")]
# the GPT-NeoX-style blocks: Phi's parallel block with biases on every projection and the
# head, StableLM 2 12B's parallel block with per-head q/k LayerNorms, GPT-NeoX's two norms
FAMILY_CASES += [("phi", "tp"), ("stablelm-qknorm", "tp"), ("gpt_neox", "tp"), ("gpt_neox", "pp")]
# DeepSeek-V2-Lite's shape (one q_proj, softmax routing, two shared experts); MiniCPM's scales
FAMILY_CASES += [("deepseek_v2", "tp"), ("minicpm", "tp")]


def _tiny(tmp_path: Path, kind: str) -> Path:
    if (tmp_path / kind / "config.json").exists():  # (written by an earlier case)
        return tmp_path / kind
    model_type = kind.split("-")[0]
    own_heads = kind in OWN_CONFIG or model_type in OWN_CONFIG  # (their tiny configs' heads)
    extra: dict = {} if own_heads else {"num_key_value_heads": 2}
    if kind == "cohere-qknorm":
        extra.update(use_qk_norm=True)
    if kind == "stablelm-qknorm":
        extra.update(qk_layernorm=True, use_parallel_residual=True)
    if kind == "gemma4_text-keqv":
        extra.update(attention_k_eq_v=True, num_global_key_value_heads=2, num_key_value_heads=4,
                     num_attention_heads=8)
    if kind == "gemma4_text-keqv2":  # (as many global KV heads as sliding ones: split alike)
        extra.update(attention_k_eq_v=True, num_global_key_value_heads=2, num_key_value_heads=2)
    if kind == "mamba2":  # two B/C groups, each with its own gated norm (one per rank at 2)
        extra.update(n_groups=2)
    if kind == "mamba2-g1":
        extra.update(n_groups=1)
    if kind == "mamba2-q4":  # in_proj rows and out_proj columns kept packed, cut on whole groups
        extra.update(quantize={"group_size": 32, "bits": 4})
    if kind == "llama-q4":
        extra.update(quantize={"group_size": 32, "bits": 4}, intermediate_size=128)
    if kind == "qwen2-untied":
        extra.update(tie_word_embeddings=False)
    if kind == "gemma4_text-moe":  # no per-layer inputs, no KV-shared layers (Gemma 4 26B's shape)
        extra.update(hidden_size_per_layer_input=0, num_kv_shared_layers=0, enable_moe_block=True,
                     num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    return write_tiny_model(tmp_path / kind, model_type, **extra)


@pytest.mark.parametrize("kind,split", FAMILY_CASES)
def test_tiny_families_two_ranks_equal_one_process(tiny_dir, kind, split):
    path = _tiny(tiny_dir, kind)
    args = ["--model", str(path), "--tokens", "12", "--logits", "--engine", "2", "--prompt", "hello world",
            "--ignore-eos"]
    one, two = alone_once(args), tp(args, split=split)
    assert two["tokens"] == one["tokens"] and len(one["tokens"]) == 12
    assert two["engine"] == one["engine"]
    diff = mx.abs(mx.array(two["logits"]) - mx.array(one["logits"])).max().item()
    assert diff < 2e-3, diff


def test_gemma4_over_four_stages(tmp_path):
    """6 layers on 4 stages (2 + 2 + 1 + 1): stage 1 computes both KV-shared layers' sources
    (its layers 2 and 3), stage 2 keeps a copy of the sliding one's cache and hands the
    global one's K/V through to stage 3. The per-layer input table quantized (one group
    per layer's columns), each stage holding its layers' columns. As one process."""
    path = write_tiny_model(tmp_path / "g", "gemma4_text", quantize={"group_size": 32, "bits": 8},
                            hidden_size_per_layer_input=32)
    args = ["--model", str(path), "--tokens", "10", "--logits", "--engine", "2", "--prompt", "hello world",
            "--ignore-eos"]
    one, four = alone(args), tp(args, n=4, split="pp")
    assert four["layers"] == 2 and four["tokens"] == one["tokens"] and four["engine"] == one["engine"]
    assert mx.abs(mx.array(four["logits"]) - mx.array(one["logits"])).max().item() < 2e-3


def test_uneven_pipeline_stages(tmp_path):
    """pipeline_layers=(4, 2) (hosts of unequal memory): stage 0 holds 4 of Gemma 4's 6
    layers, both KV-shared layers' sources among them; stage 1 the two shared layers, each
    over a copy of its source's cache. As one process."""
    path = write_tiny_model(tmp_path / "g", "gemma4_text")
    args = ["--model", str(path), "--tokens", "10", "--logits", "--engine", "2", "--prompt", "hello world",
            "--ignore-eos"]
    one, two = alone(args), tp(args + ["--pp-layers", "4,2"], split="pp")
    assert two["layers"] == 4 and two["tokens"] == one["tokens"] and two["engine"] == one["engine"]
    assert two["fingerprint"] == one["fingerprint"] + "-pp0of2-layers0to4"  # (a disk prefix cache's key)
    assert mx.abs(mx.array(two["logits"]) - mx.array(one["logits"])).max().item() < 2e-3


def test_the_kv_budget_is_the_smallest_ranks(tmp_path):
    """Stages of 1 and 3 layers: stage 1 holds 3x stage 0's KV bytes per token, so a byte
    budget allows it a third of the tokens; every rank takes that budget (rank 0's alone
    would let stage 1 hold 3x its bytes), and runs as one process does."""
    from fx_engine.testing.distributed import launch_local

    path = write_tiny_model(tmp_path / "m", "llama", num_hidden_layers=4)
    args = ["--model", str(path), "--tokens", "8", "--ignore-eos", "--lockstep", "2", "--kv-budget-bytes", "2000000"]
    one = alone(args)
    ranks = launch_local(2, RUN + ["--pp", "2", "--pp-layers", "1,3", "--all-ranks", *args], timeout=240)
    assert all(r.returncode == 0 for r in ranks), ranks[0].stderr[-3000:] + ranks[1].stderr[-3000:]
    got = [json.loads(r.stdout.strip().splitlines()[-1]) for r in ranks]
    assert got[1]["bytes_per_token"] == 3 * got[0]["bytes_per_token"] == 3 * one["bytes_per_token"] // 4
    assert got[0]["kv_budget_tokens"] == got[1]["kv_budget_tokens"] == 2000000 // got[1]["bytes_per_token"]
    assert got[0]["lockstep"] == one["lockstep"]


def test_a_gemma4_stage_holds_its_share_of_the_per_layer_table(tmp_path):
    """The per-layer input table (E2B/E4B's largest tensor) splits by stage: stage 1 of 2
    holds its 3 layers' columns and its projection's rows, not the first stage's."""
    from fx_engine.core.parallel import stage_params

    model = fx_engine.load(write_tiny_model(tmp_path / "g", "gemma4_text"))
    hpl, p = model.config.hidden_size_per_layer_input, model.params
    stage = stage_params(p, 1, 2)
    assert stage.embed_per_layer.weight.shape == (model.config.vocab_size, 3 * hpl)
    assert mx.array_equal(stage.embed_per_layer.weight, p.embed_per_layer.weight[:, 3 * hpl:]).item()
    proj = p.per_layer_proj  # (stored [in, out] on the CPU: transposed)
    rows = proj.weight[:, 3 * hpl:] if proj.transposed else proj.weight[3 * hpl:]
    assert mx.array_equal(stage.per_layer_proj.weight, rows).item() and stage.per_layer_proj.out_features == 3 * hpl
    assert stage.config.stage_kv_in == ("full_attention",) and stage.config.borrowed_kv == ("full_attention",)


def test_four_ranks_share_a_mamba_group(tmp_path):
    """4 ranks over a Mamba-2 of 8 heads in 2 B/C groups: each rank's 2 heads lie in one
    group, which two ranks replicate; its norm over every rank's channels. As one process."""
    path = write_tiny_model(tmp_path / "m", "mamba2")
    args = ["--model", str(path), "--tokens", "8", "--logits", "--engine", "2", "--ignore-eos"]
    one, four = alone(args), tp(args, n=4)
    assert four["heads"] == 2 and four["tokens"] == one["tokens"] and four["engine"] == one["engine"]
    assert mx.abs(mx.array(four["logits"]) - mx.array(one["logits"])).max().item() < 2e-3


# Tensor x pipeline: 2 stages of 2 ranks each, on MPI (the MLX backend with subgroups;
# .ci/run installs Open MPI). Each stage's layers split over its ranks: collectives on the
# stage's group, activations to the same tensor rank of the next stage.
needs_mpi = pytest.mark.skipif(mpirun() is None and not os.environ.get("CI"),
                               reason="Open MPI's mpirun is not installed (.ci/run installs it; under CI: fails)")


def mesh(args: list[str], timeout: float = 300) -> dict:
    got = launch_mpi(4, RUN + ["--tp", "2", "--pp", "2", *args], timeout=timeout)
    assert got.returncode == 0, f"{got.returncode}\n{got.stderr[-3000:]}"
    return json.loads(got.stdout.strip().splitlines()[-1])


@needs_mpi
@pytest.mark.slow
def test_default_model_tensor_by_pipeline_equals_one_process():
    """SmolLM2 on 4 ranks: 15 layers per stage, each stage's 3 KV heads split 2 + 1 (query
    heads 6 + 3), MLP and vocabulary halved. Greedy tokens (plain, a continuous batch, and
    a lockstep engine as `serve` runs it), and the logits, as one process computes them."""
    args = ["--tokens", "16", "--logits", "--engine", "3", "--lockstep", "2"]
    one, four = alone(args), mesh(args)
    assert (four["size"], four["heads"], four["kv_heads"], four["layers"]) == (4, 6, 2, 15)
    assert four["tokens"] == one["tokens"] and len(one["tokens"]) == 16
    assert four["engine"] == one["engine"] and four["lockstep"] == one["lockstep"]
    assert mx.abs(mx.array(four["logits"]) - mx.array(one["logits"])).max().item() < 2e-3


@needs_mpi
@pytest.mark.parametrize("kind", ["qwen3_moe", "olmo2", "mamba2-g1", "gemma4_text", "deepseek_v3"])
def test_tiny_families_tensor_by_pipeline_equal_one_process(tmp_path, kind):
    """Experts split per stage (qwen3_moe), norms whose mean square spans the stage's ranks
    (OLMo's q/k norms, a one-group Mamba-2's gated norm: the all_sum on the stage's group),
    Gemma 4's own split with its handed-on K/V (each tensor rank's KV heads to the same
    tensor rank of the next stage) and per-layer inputs, DeepSeek's latent attention."""
    path = _tiny(tmp_path, kind)
    args = ["--model", str(path), "--tokens", "10", "--logits", "--engine", "2", "--prompt", "hello world",
            "--ignore-eos"]
    one, four = alone(args), mesh(args)
    assert four["tokens"] == one["tokens"] and len(one["tokens"]) == 10
    assert four["engine"] == one["engine"]
    assert mx.abs(mx.array(four["logits"]) - mx.array(one["logits"])).max().item() < 2e-3


@needs_mpi
def test_dora_adapter_tensor_by_pipeline_equals_one_process(tmp_path):
    """A DoRA adapter on every projection: each stage applies its layers' modules, each of
    its ranks its slice, the row norms summed over the stage's ranks."""
    args = _adapter_args(tmp_path, dora=True, tokens=10)
    one, four = alone(args), mesh(args)
    assert four["tokens"] == one["tokens"] and four["engine"] == one["engine"]
    assert mx.abs(mx.array(four["logits"]) - mx.array(one["logits"])).max().item() < 2e-3


@needs_mpi
@pytest.mark.real_model
def test_cli_generate_tensor_by_pipeline(tmp_path):
    """The command line under mpirun: rank 0 prints what one process prints; every rank
    ends cleanly (MPI finalized before MLX frees the subgroups: mpirun exits 0)."""
    path = _tiny(tmp_path, "qwen3")
    cmd = [sys.executable, "-m", "fx_engine.cli", "generate", "hello world", "--raw", "--max-tokens", "8",
           "--model", str(path), "--tensor-parallel", "2", "--pipeline-parallel", "2"]
    got = launch_mpi(4, cmd, timeout=240)
    assert got.returncode == 0, got.stderr[-3000:]
    want = fx_engine.generate(fx_engine.load(path), "hello world", max_tokens=8, temperature=0.0)
    assert got.stdout.strip() == want.text.strip()


def _served_like_one_process(client, prompts: list[str]) -> tuple:
    """Concurrent greedy completions from a sharded server equal one process's; then a stream
    the client abandons after two chunks (rank 0 cancels the row, and so do the others).
    Returns the one-process model and its completions."""
    import concurrent.futures

    model = fx_engine.load()
    want = [fx_engine.generate(model, p, max_tokens=12, temperature=0.0).text for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: client.completions.create(model="smol", prompt=p, max_tokens=12,
                                                                temperature=0).choices[0].text, prompts))
    assert got == want
    with client.completions.create(model="smol", prompt="Count: 1, 2, 3,", max_tokens=200, stream=True) as st:
        for i, _ in enumerate(st):
            if i == 1:
                break
    return model, want


@needs_mpi
@pytest.mark.slow
def test_server_tensor_by_pipeline_with_the_openai_client():
    """`mpirun -np 4 fx-engine serve --tensor-parallel 2 --pipeline-parallel 2`: rank 0
    serves and schedules, the other three follow its steps. Concurrent requests, a stream the
    client abandons, a JSON-object grammar; SIGTERM to rank 0 ends every rank cleanly."""
    import signal

    from openai import OpenAI

    from fx_engine.testing.distributed import mpi_rank_pid, start_mpi, wait_mpi

    from tests.conftest import free_port, wait_healthy

    port = free_port()
    proc = start_mpi(4, [sys.executable, "-m", "fx_engine.cli", "serve", "--tensor-parallel", "2", "--numerics", "exact",
                         "--pipeline-parallel", "2", "--port", str(port), "--model-id", "smol"],
                     env={"FX_ENGINE_TP_TIMEOUT": "30"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [proc], timeout=240)
        client = OpenAI(base_url=url + "/v1", api_key="none")
        model, _ = _served_like_one_process(client, ["The capital of France is", "List three colors:",
                                                     "def add(a, b):"])
        msgs = [{"role": "user", "content": "A JSON object?"}]
        r = client.chat.completions.create(model="smol", messages=msgs, max_tokens=24, temperature=0,
                                           response_format={"type": "json_object"})
        assert r.choices[0].message.content == fx_engine.generate(
            model, msgs, max_tokens=24, temperature=0.0, response_format={"type": "json_object"}).text
        os.kill(mpi_rank_pid(proc, 0), signal.SIGTERM)
        end = wait_mpi(proc, timeout=120)
    finally:
        if proc.poll() is None:  # (a failure above: the whole group goes)
            os.killpg(proc.pid, signal.SIGKILL)
    assert end.returncode == 0, end.stderr[-3000:]


SCRIPT = """
import sys, fx_engine
m = fx_engine.load(sys.argv[1], tensor_parallel=2, pipeline_parallel=2)
print(fx_engine.generate(m, "hello world", max_tokens=4, temperature=0.0).text == sys.argv[2], flush=True)
if sys.argv[3] == "raise":
    raise RuntimeError("the script failed")
"""


@needs_mpi
@pytest.mark.parametrize("end", ["return", "raise"])
def test_a_script_without_finish_ends_cleanly(tmp_path, end):
    """A Python script that never calls finish(): the exit handler finalizes MPI before MLX
    frees the subgroups, so the group ends with status 0 (1 after an uncaught exception),
    not an Open MPI abort."""
    path = _tiny(tmp_path, "qwen3")
    want = fx_engine.generate(fx_engine.load(path), "hello world", max_tokens=4, temperature=0.0).text
    got = launch_mpi(4, [sys.executable, "-c", SCRIPT, str(path), want, end], timeout=240)
    assert "MPI_FINALIZE" not in got.stderr
    if end == "return":
        assert got.returncode == 0, got.stderr[-3000:]
        assert got.stdout.count("True") == 4 and "False" not in got.stdout  # (lines may interleave)
    else:  # (mpirun stops the job at the first failed rank: the others' output may be cut)
        assert "True" in got.stdout and "False" not in got.stdout
        assert got.returncode not in (0, None) and "the script failed" in got.stderr


@needs_mpi
def test_a_lost_rank_under_mpi_ends_the_run(tmp_path):
    got = launch_mpi(4, RUN + ["--tp", "2", "--pp", "2", "--model", str(_tiny(tmp_path, "qwen3")), "--tokens",
                               "100000", "--ignore-eos", "--die-after", "4"], timeout=120)
    assert got.returncode not in (0, None), got.stderr[-2000:]
    assert got.seconds < 90


def test_tensor_by_pipeline_on_the_ring_backend_is_a_clear_error():
    """The ring backend has no subgroups: every rank stops with an error that says to use MPI."""
    ranks = launch_local(4, RUN + ["--tp", "2", "--pp", "2"], timeout=120)
    for r in ranks:
        assert r.returncode != 0 and "launch with `mpirun -np 4" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("split", ["tp", "pp"])
def test_every_family_has_a_case(split):
    """A family added to the registry is run split both ways here, or this fails."""
    from fx_engine.core.models import FAMILIES, model_types

    covered = {model_types()[k.split("-")[0]] for k, s in FAMILY_CASES if s == split}
    assert covered == {f.name for f in FAMILIES}


def test_sampled_rows_reproducible_with_a_seed():
    args = ["--tokens", "16", "--seed", "7"]
    a, b = tp(args), tp(args)
    assert a["tokens"] == b["tokens"] == alone(args)["tokens"]


def test_unseeded_sampling_is_the_same_on_every_rank():
    """Every rank runs the same program (no lockstep): a request without a seed gets the
    same default seed on every rank, so the ranks sample the same tokens."""
    ranks = launch_local(2, RUN + ["--tp", "2", "--tokens", "24", "--sample", "--ignore-eos", "--engine", "2",
                                   "--all-ranks"], timeout=240)
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr[-2000:]
    outs = [json.loads(r.stdout.strip().splitlines()[-1]) for r in ranks]
    assert outs[0]["tokens"] == outs[1]["tokens"] and len(outs[0]["tokens"]) == 24
    assert outs[0]["engine"] == outs[1]["engine"]


def test_a_lost_rank_is_an_error_not_a_hang():
    ranks = launch_local(2, RUN + ["--tp", "2", "--tokens", "2000", "--ignore-eos", "--die-after", "4"], timeout=120,
                         env={"FX_ENGINE_TP_TIMEOUT": "6"})
    assert ranks[1].returncode == 3  # the rank that died
    assert ranks[0].returncode == 70, ranks[0].stderr[-2000:]
    assert "another rank has failed" in ranks[0].stderr
    assert ranks[0].seconds < 90


@pytest.mark.real_model
def test_cli_generate_tensor_parallel(tmp_path):
    cmd = [sys.executable, "-m", "fx_engine.cli", "generate", "The capital of France is", "--raw",
           "--max-tokens", "8", "--tensor-parallel", "2", "--numerics", "exact"]
    ranks = launch_local(2, cmd, timeout=240)
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr[-2000:]
    want = fx_engine.generate(fx_engine.load(), "The capital of France is", max_tokens=8, temperature=0.0)
    assert ranks[0].stdout.strip() == want.text.strip()
    assert ranks[1].stdout == ""  # the other rank runs silently


@pytest.mark.real_model
def test_cli_chat_tensor_parallel():
    """Rank 0 reads the terminal and sends each line; every rank runs the conversation."""
    cmd = [sys.executable, "-m", "fx_engine.cli", "chat", "--max-tokens", "8", "--tensor-parallel", "2", "--numerics", "exact",
           "--temp", "0"]  # (chat samples by default: the model's settings or llama.cpp's)
    ranks = launch_local(2, cmd, timeout=240, input="What is the capital of France?\nAnd of Italy?\n")
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr[-2000:]
    model = fx_engine.load()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    first = fx_engine.generate(model, msgs, max_tokens=8, temperature=0.0).text
    msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "And of Italy?"}]
    second = fx_engine.generate(model, msgs, max_tokens=8, temperature=0.0).text
    assert ranks[0].stdout == first + "\n" + second + "\n"
    assert ranks[1].stdout == ""


def test_misuse_is_a_clear_error(tmp_path, capsys):
    from fx_engine.cli import main
    from fx_engine.core.parallel import shard_params

    with pytest.raises(ValueError, match="mlx.launch -n 2"):
        fx_engine.load(tensor_parallel=2)  # one process alone
    with pytest.raises(ValueError, match="needs 4 processes"):
        fx_engine.load(tensor_parallel=2, pipeline_parallel=2)
    with pytest.raises(ValueError, match="pipeline_layers has 2 counts but pipeline_parallel=3"):
        fx_engine.load(pipeline_parallel=3, pipeline_layers=[20, 10])
    for bad in ([20, 0], [], "20,10", [20.0, 10]):
        with pytest.raises(ValueError, match="pipeline_layers must be a list of positive layer counts"):
            fx_engine.load(pipeline_layers=bad)
    with pytest.raises(ValueError, match="needs 2 processes"):  # (the counts imply 2 stages)
        fx_engine.load(pipeline_layers=[20, 10])
    with pytest.raises(ConfigError, match="sum to the model's 30 layers"):  # (one stage: checked too)
        fx_engine.load(pipeline_layers=[31])
    from fx_engine.core.parallel import stage_layers

    assert stage_layers(30, 2) == [(0, 15), (15, 30)] and stage_layers(30, 2, (20, 10)) == [(0, 20), (20, 30)]
    with pytest.raises(ConfigError, match="2 layer counts of at least 1 that sum to the model's 30 layers"):
        stage_layers(30, 2, (20, 11))
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--pipeline-layers", "20,x"])
    assert e.value.code == 2 and "expected positive layer counts such as 20,10" in capsys.readouterr().err
    mamba = fx_engine.load(write_tiny_model(tmp_path / "m", "mamba2", n_groups=2))  # 8 heads in 2 B/C groups
    with pytest.raises(ConfigError, match="heads 3..5 span 2 of its B/C groups"):  # 3 + 3 + 2 heads
        shard_params(mamba.params, 0, 3)  # (rank 1's heads; every rank refuses alike)
    moe = fx_engine.load(write_tiny_model(tmp_path / "q", "qwen3_moe", quantize={"group_size": 32, "bits": 4}))
    with pytest.raises(ConfigError, match="1 parts cannot be split over 2 ranks"):  # 32 features: one group
        shard_params(moe.params, 0, 2)
    cohere = fx_engine.load(write_tiny_model(tmp_path / "c", "cohere2"))
    assert main(["serve", "--tensor-parallel", "2"]) == 2  # one process alone
    assert "mlx.launch -n 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not tensor-parallel"):
        fx_engine.Engine(cohere, lockstep=True)


@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_server_tensor_parallel_with_the_openai_client(tmp_path, split):
    """`fx-engine serve --tensor-parallel 2` on 2 ranks: rank 0 serves HTTP and schedules,
    rank 1 follows its steps (lockstep). Concurrent requests, a streamed one the client
    abandons (a cancellation both ranks apply), prompt-lookup speculation on every request
    (rank 0's decisions), then a graceful shutdown that ends both ranks. Tensor: idle for
    longer than the lost-rank timeout, rank 0's heartbeats keep rank 1's watchdog quiet."""
    import signal
    import time

    from openai import OpenAI

    from fx_engine.testing.distributed import start_local, wait_local

    from tests.conftest import free_port, wait_healthy

    port = free_port()
    procs = start_local(2, [sys.executable, "-m", "fx_engine.cli", "serve", f"--{split}-parallel", "2", "--numerics", "exact",
                            "--port", str(port), "--model-id", "smol", "--prompt-lookup",
                            # a small prefix cache: entries are evicted, alike on both ranks
                            # (rank 0 holds 2 of SmolLM2's 3 KV heads, rank 1 one)
                            "--prompt-cache-bytes", "1500000"],
                        env={"FX_ENGINE_TP_TIMEOUT": "12" if split == "tensor" else "20"})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, procs)
        client = OpenAI(base_url=url + "/v1", api_key="none")
        prompts = ["The capital of France is", "List three colors:", "def add(a, b):", "Once upon a time"]
        model, want = _served_like_one_process(client, prompts)
        text = "Copy: the cat sat on the mat. Copy: the cat sat on the mat. Copy:"
        r = client.completions.create(model="smol", prompt=text, max_tokens=16, temperature=0)
        assert r.choices[0].text == fx_engine.generate(model, text, max_tokens=16, temperature=0.0).text
        r = client.completions.create(model="smol", prompt=prompts[1], max_tokens=12, temperature=0.8, seed=5)
        assert r.choices[0].text == fx_engine.generate(model, prompts[1], max_tokens=12, temperature=0.8,
                                                       seed=5).text
        r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "A JSON object?"}],
                                           max_tokens=24, response_format={"type": "json_object"}, temperature=0)
        assert r.choices[0].message.content == fx_engine.generate(
            model, [{"role": "user", "content": "A JSON object?"}], max_tokens=24, temperature=0.0,
            response_format={"type": "json_object"}).text  # every rank's grammar in step
        if split == "tensor":
            time.sleep(13)  # idle past the timeout: rank 0's heartbeats (every 3 s) keep rank 1's watchdog quiet
        assert client.completions.create(model="smol", prompt=prompts[0], max_tokens=12,
                                         temperature=0).choices[0].text == want[0]
    finally:
        procs[0].send_signal(signal.SIGTERM)
        ranks = wait_local(procs, timeout=120)
    assert [r.returncode for r in ranks] == [0, 0], ranks[1].stderr[-3000:]


def _adapter_args(tmp_path: Path, dora: bool, tokens: int) -> list[str]:
    """tp_run arguments for a tiny Qwen3 with a LoRA / DoRA adapter on every projection."""
    from tools.oracle import write_mlx_lm_adapter

    path = write_tiny_model(tmp_path / "m", "qwen3", num_key_value_heads=2)
    ad = write_mlx_lm_adapter(path, tmp_path / "ad", rank=4, dora=dora, init_scale=0.1,
                              keys=["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                    "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"])
    return ["--model", str(path), "--tokens", str(tokens), "--logits", "--engine", "2", "--prompt",
            "hello world", "--adapter", str(ad)]


@pytest.mark.parametrize("split", ["tp", "pp"])
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_adapters_on_two_ranks_equal_one_process(tmp_path, split, dora):
    """A LoRA / DoRA adapter on every projection served by a sharded model: a tensor-parallel
    rank applies its slice of each factor (B's rows of its heads and features; A's rows of
    its input slice for o and down, whose partial products are summed with the base's;
    DoRA's row norms summed over the ranks); a pipeline stage applies its layers' modules."""
    args = _adapter_args(tmp_path, dora=dora, tokens=12)
    one, two = alone(args), tp(args, split=split)
    assert two["tokens"] == one["tokens"] and two["engine"] == one["engine"]
    diff = mx.abs(mx.array(two["logits"]) - mx.array(one["logits"])).max().item()
    assert diff < 2e-3, diff
    base = alone(args[:-2])
    assert mx.abs(mx.array(base["logits"]) - mx.array(one["logits"])).max().item() > 1e-2  # it matters


@pytest.mark.parametrize("split,draft", [("tp", "file"), ("tp", "self"), ("pp", "file")])
def test_draft_models_on_two_ranks_equal_one_process(tmp_path, split, draft):
    """Speculative decoding with a draft model on a sharded target: a separate draft (whole
    on every rank) or the target's own first layers (sharded like it, tensor parallel). The
    plain generate (every rank the same program) and a lockstep Engine, where rank 0's
    requests reach the other ranks with the draft named by its place in Engine(drafts=): greedy tokens
    as one process's, and drafts were made and checked."""
    target = write_tiny_model(tmp_path / "t", "llama", num_hidden_layers=4, seed=1)
    spec = str(write_tiny_model(tmp_path / "d", "llama", num_hidden_layers=1, seed=1)) if draft == "file" else "self:2"
    args = ["--model", str(target), "--tokens", "12", "--ignore-eos", "--draft", spec, "--lockstep", "2"]
    one, two = alone(args), tp(args, split=split)
    assert two["tokens"] == one["tokens"] and two["lockstep"] == one["lockstep"]
    assert two["drafted"] > 0 and one["drafted"] > 0  # (how many: timing-adapted, rank 0's plan)


@pytest.mark.parametrize("split", ["tp", "pp"])
@pytest.mark.parametrize("family", ["gemma3", "idefics3", "qwen2_5_vl", "qwen3_vl"])
def test_images_on_two_ranks_equal_one_process(tmp_path, family, split):
    """Image prompts on a sharded model: tensor-parallel ranks each splice the image rows into
    their whole hidden states; on a pipeline the first stage splices them and every stage
    rotates with the prompt's M-RoPE positions (Qwen3-VL's DeepStack rows added at the first
    layers, counted over the whole model). The plain generate (each rank encodes the same
    image) and a lockstep Engine (rank 0 encodes and sends the rows with the request's
    record) give one process's greedy tokens."""
    from fx_engine.testing.vision import (write_tiny_gemma3_vlm, write_tiny_idefics3, write_tiny_qwen2_vl,
                                          write_tiny_qwen3_vl)

    if family == "gemma3":
        folder = write_tiny_gemma3_vlm(tmp_path / "m")
    else:  # 4 text layers: a stage after the first attends over image positions a stage changed
        writer = {"idefics3": write_tiny_idefics3, "qwen2_5_vl": write_tiny_qwen2_vl, "qwen3_vl": write_tiny_qwen3_vl}
        folder = writer[family](tmp_path / "m", text={"num_hidden_layers": 4})
    args = ["--model", str(folder), "--image", "3", "--tokens", "10", "--ignore-eos", "--lockstep", "2"]
    one, two = alone(args), tp(args, split=split)
    assert two["tokens"] == one["tokens"] and two["lockstep"] == one["lockstep"]
    assert alone(args[:2] + args[4:])["tokens"] != one["tokens"]  # (the image matters)


@pytest.mark.parametrize("split,model", [("tp", None), ("pp", None), ("tp", "mamba2"), ("pp", "gemma4_text")])
def test_prefix_disk_tier_on_two_ranks(tmp_path, split, model):
    """The prefix cache's disk tier with a sharded model: each rank writes its share of every
    entry into its own subdirectory; a second engine (an empty memory tier) restores the
    prompts from disk on every rank alike (the length all ranks hold), with the tokens of a
    cold run. mamba2: recurrent states (each rank's heads), restored at a snapshot. Gemma 4
    on 2 stages: stage 1's copy of stage 0's global layer's entry (sliding windows of 16
    tokens: rings) saved and restored with its own entries."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    args = ["--tokens", "8", "--lockstep", "2", "--prompt", prompt, "--ignore-eos"]
    if model:
        args += ["--model", str(write_tiny_model(tmp_path / model, model))]
    cold = alone(args)
    two = tp(args + ["--prefix-dir", str(tmp_path / "kv")], split=split)
    assert two["lockstep"] == cold["lockstep"]
    # (the first pass's first request finds nothing; its second may find the first's
    # prefix in memory, if admitted after the first's prefill: timing, rank 0's decision)
    assert two["cached"][0][0] == 0 and min(two["cached"][1]) >= 32, two["cached"]
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["rank0of2", "rank1of2"]
    assert all(any(p.glob("*.safetensors")) for p in (tmp_path / "kv").iterdir())


@pytest.mark.real_model
def test_lockstep_drafts_must_be_registered_and_self_drafts_need_the_layers():
    from fx_engine.engine.drafters import self_draft_model

    model = fx_engine.load()
    with pytest.raises(ValueError, match="drafts"):
        fx_engine.Engine(model, drafts=["not a model"])
    draft = self_draft_model(model, 4)
    engine = fx_engine.Engine(model, lockstep=False, drafts=[draft])
    assert engine._draft_ref({"draft_model": draft})["draft_model"].index == 0
    engine.close()
    with pytest.raises(ValueError, match="Engine\\(drafts"):
        fx_engine.Engine(model)._draft_ref({"draft_model": draft})


def both_splits_equal_one_process(args: list[str]) -> tuple[dict, dict]:
    """tools/tp_run.py on 2 ranks, tensor then pipeline parallel, against one process:
    greedy tokens and the engine's equal, logits within 1e-3 of their scale. Returns rank
    0's reports (tp, pp)."""
    one, out = alone(args), []
    for split in ("tp", "pp"):
        two = tp(args, split=split)
        assert two["tokens"] == one["tokens"] and two["engine"] == one["engine"], split
        diff = mx.abs(mx.array(two["logits"]) - mx.array(one["logits"])).max().item()
        assert diff < 1e-3 * mx.abs(mx.array(one["logits"])).max().item(), (split, diff)
        out.append(two)
    return out[0], out[1]


@pytest.mark.real_model
def test_kquant_gguf_on_two_ranks_equals_one_process(tmp_path):
    """A Q4_K_M-like GGUF sharded: 6-bit Q6_K down projections split along their input
    (whole words and super-blocks: the two-level scales stay), Q4_K output projections
    whose halves cut a super-block (expanded to float32 scales first), 5-bit fusions."""
    from fx_engine.loading.default_model import default_model_path

    from tests.models.test_gguf_kquant import write_kquant_gguf

    path, _ = write_kquant_gguf(tmp_path, default_model_path(), untied=True)
    both_splits_equal_one_process(["--model", str(path), "--tokens", "12", "--logits", "--engine", "2",
                                   "--ignore-eos"])


@pytest.mark.parametrize("keep", [False, True], ids=["cpu-default", "kept"])
def test_gpt_oss_mxfp4_gguf_on_two_ranks_equals_one_process(tmp_path, keep):
    """GPT-OSS as llama.cpp writes it, split over 2 ranks: MXFP4 expert stacks (kept packed:
    each rank's slice of every expert's features, whole groups of 32; the down projections'
    biases added on the first rank only, the mixture summed), attention sinks split with
    their query heads; keep: the attention projections' 2-D MXFP4 kept too (MLX's kernels,
    the GPU's form). Both splits against one process."""
    from tests.models.test_gguf_conversion import _gpt_oss_gguf

    folder = write_tiny_model(tmp_path / "m", "gpt_oss", num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=64)  # two groups of 32 features per expert
    _gpt_oss_gguf(folder, tmp_path / "m.gguf", True, matrices=True)
    args = ["--model", str(tmp_path / "m.gguf"), "--tokens", "12", "--logits", "--engine", "2",
            "--ignore-eos"] + (["--keep-quantized"] if keep else [])
    tp2, pp2 = both_splits_equal_one_process(args)
    assert (tp2["heads"], tp2["layers"], pp2["heads"], pp2["layers"]) == (2, 4, 4, 2)  # rank 0's share


def test_deepseek_gguf_on_two_ranks_equals_one_process(tmp_path):
    """DeepSeek as llama.cpp writes it (separate k_b / v_b, 8-bit experts), split both ways:
    the per-head maps derived from the file's tensors cut by heads, the experts' features
    on whole groups (64 features: two groups of 32)."""
    from tests.models.test_gguf_conversion import _deepseek_gguf

    folder = write_tiny_model(tmp_path / "m", "deepseek_v3", moe_intermediate_size=64, intermediate_size=128)
    _deepseek_gguf(folder, tmp_path / "m.gguf", True)
    both_splits_equal_one_process(["--model", str(tmp_path / "m.gguf"), "--tokens", "10", "--logits", "--engine",
                                   "2", "--ignore-eos"])


def test_each_rank_holds_about_its_share(tmp_path):
    """Sharded before anything is evaluated (safetensors are read lazily, one leaf at a
    time): each of 2 ranks holds half the params, and its peak memory while loading is
    about the shard plus one tensor, not the whole model."""
    path = write_tiny_model(tmp_path / "m", "llama", hidden_size=512, num_hidden_layers=16, intermediate_size=2048,
                            vocab_size=8000, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                            dtype="float16")
    args = ["--model", str(path), "--tokens", "2"]
    one, two = alone(args), tp(args)
    assert abs(two["params_bytes"] - one["params_bytes"] / 2) < 0.02 * one["params_bytes"]
    # the whole model is ~270 MB in float32: a rank that loaded it all would peak above it
    assert two["peak_rss_after_load"] < one["peak_rss_after_load"] - 0.25 * one["params_bytes"], (one, two)


@pytest.mark.parametrize("split", ["tp", "pp"])
def test_each_rank_reads_about_its_share_of_a_gguf(tmp_path, split):
    """A GGUF file sharded: each converted tensor is spilled to a temporary safetensors file
    and read back lazily, so a rank's peak memory while loading is about its shard, not the
    whole model (which every rank converted whole before); the spill folder is removed."""
    import json as _json

    from tests.models.test_gguf_conversion import _common, convert

    folder = write_tiny_model(tmp_path / "m", "llama", hidden_size=512, num_hidden_layers=16, intermediate_size=2048,
                              vocab_size=8000, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                              dtype="float16")
    cfg = _json.loads((folder / "config.json").read_text())
    convert(folder, tmp_path / "m.gguf", "llama", {**_common(cfg), "vocab_size": cfg["vocab_size"]}, permute=True,
            q8_mlp=False)
    spill = tmp_path / "spill"
    spill.mkdir()
    args = ["--model", str(tmp_path / "m.gguf"), "--tokens", "4"]
    one, two = alone(args), tp(args, split=split, env={"FX_ENGINE_SPILL_DIR": str(spill)})
    assert two["tokens"] == one["tokens"]
    assert two["peak_rss_after_load"] < one["peak_rss_after_load"] - 0.25 * one["params_bytes"], (one, two)
    assert not any(spill.iterdir())  # each rank's spill folder is gone


def test_the_spill_folder_avoids_memory_backed_temp(tmp_path, monkeypatch):
    """A sharded GGUF load converts into the system's temporary folder unless that is a
    tmpfs (its files in RAM, as much as sharding saves): then fx-engine's cache folder on
    disk. FX_ENGINE_SPILL_DIR wins either way."""
    from fx_engine.loading.model import ram_backed, spill_dir

    mounts = "/dev/vda / ext4 rw 0 0\ntmpfs /tmp tmpfs rw 0 0\nnone /tmp/disk\\040x ext4 rw 0 0\n"
    assert ram_backed("/tmp/a", mounts) and ram_backed("/tmp", mounts)
    assert not ram_backed("/tmpfoo", mounts) and not ram_backed("/tmp/disk x/y", mounts)
    monkeypatch.delenv("FX_ENGINE_SPILL_DIR", raising=False)
    monkeypatch.setenv("FX_ENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("tempfile.tempdir", "/tmp")
    assert spill_dir(mounts) == str(tmp_path / "cache" / "spill") and (tmp_path / "cache" / "spill").is_dir()
    assert spill_dir("/dev/vda / ext4 rw 0 0\n") is None  # the system's temporary folder
    monkeypatch.setenv("FX_ENGINE_SPILL_DIR", str(tmp_path))
    assert spill_dir(mounts) == str(tmp_path)

