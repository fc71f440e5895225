"""The planner on Hugging Face model directories (config.json only) and LoRA (frozen = parameter bytes)."""

from __future__ import annotations

import json

import pytest

from offload.cli import main
from offload.errors import ConfigError
from offload.models.llama import LlamaConfig
from offload.plan import Hardware, Policy, plan
from offload.plan.model import param_numels
from tests.helpers.hf_models import tiny_config

transformers = pytest.importorskip("transformers")


BOX = dict(gpu_mem=None, cpu_mem=64 << 30, nvme_capacity=1 << 40, nvme_read_gbps=2.0, nvme_write_gbps=2.0,
           compute_tflops=0.1, adam_params_per_s=1e9)
STATED = ["--cpu-mem", "64G", "--nvme-capacity", "1T", "--nvme-gbps", "2", "--cpu-gflops", "100",
          "--adam-params-per-s", "1e9"]


@pytest.fixture
def llama_dir(tmp_path):
    """A config.json only: the planner needs no weights."""
    tiny_config("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3).save_pretrained(tmp_path)
    return tmp_path


def test_hf_llama_is_planned_like_the_same_shape(llama_dir):
    from offload.hf.describe import describe

    d = describe(llama_dir)
    same = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                       num_kv_heads=2, max_seq_len=128)
    assert d.shape == same
    assert [n for n, _ in d.params] == param_numels(same) and all(t for _, t in d.params)
    policy = Policy(batch_tokens=256, seq_len=64, device_budget=8 << 20, cpu_budget=8 << 20)
    mine = plan(d.shape, Hardware(**BOX), policy, params=d.params).to_json_dict()
    preset_like = plan(same, Hardware(**BOX), policy).to_json_dict()
    for key in ("params", "tiers", "nvme_bytes_needed", "bytes_per_step", "step_terms_s"):
        assert mine[key] == preset_like[key], key


def test_lora_frozen_parameters_cost_only_parameter_chunks(llama_dir):
    from offload.hf.describe import describe
    from offload.hf.lora import LoraSettings

    full = describe(llama_dir)
    lora = describe(llama_dir, LoraSettings(rank=4, targets=("q_proj", "v_proj")))
    # per layer: q (64 -> 64) and v (64 -> 32), A: r x in, B: out x r
    assert lora.trainable == 3 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)
    assert lora.total == full.total + lora.trainable
    policy = Policy(batch_tokens=256, seq_len=64, chunk_size=16384, device_budget=8 << 20, cpu_budget=8 << 20)
    p_full = plan(full.shape, Hardware(**BOX), policy, params=full.params)
    p_lora = plan(lora.shape, Hardware(**BOX), policy, params=lora.params)
    b = p_lora.breakdown
    assert b["trainable_params"] == lora.trainable and b["trainable_chunks"] == 1
    from offload.plan.model import chunk_sizes

    layout = ([k for k, _ in lora.params], [t for _, t in lora.params])
    _, sizes, trainable = chunk_sizes(lora.shape, 8 << 20, 8 << 20, 16384, layout=layout)
    assert len(sizes) == b["num_chunks"] and sum(trainable) == 1
    # bf16: every chunk has 2 B parameters; only the trainable one (cut to the adapters' size) has
    # grads, master and moments
    trained = sum(n for n, t in zip(sizes, trainable) if t)
    assert lora.trainable <= trained < lora.trainable + 16384
    assert p_lora.nvme_bytes_needed == sum(sizes) * 2 + trained * (4 + 4 + 4 + 4)
    assert sum(n for n, t in zip(sizes, trainable) if not t) >= full.total - lora.trainable
    assert p_lora.nvme_bytes_needed < p_full.nvme_bytes_needed / 4
    assert p_lora.step_terms_s["adam"] < p_full.step_terms_s["adam"] / 10


def test_plan_command_prints_full_and_lora(llama_dir, capsys):
    assert main(["plan", "--model", str(llama_dir), "--lora-rank", "4", "--batch-tokens", "256", *STATED]) == 0
    out = capsys.readouterr().out
    plans = [line for line in out.splitlines() if line.startswith("offload plan:")]
    assert len(plans) == 2 and "LoRA r=4" in plans[1] and "trainable" in plans[1]
    assert main(["plan", "--model", str(llama_dir), "--lora-rank", "4", "--batch-tokens", "256", *STATED,
                 "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["breakdown"]["trainable_params"] < data["params"]


def test_plan_command_errors(tmp_path, capsys):
    assert main(["plan", "--model", "llama-tiny", "--lora-rank", "4", "--lora-targets", "qkv", *STATED]) == 1
    assert "lora_targets" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    assert main(["plan", "--model", str(tmp_path), *STATED]) == 1
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ConfigError):
        plan(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                         num_kv_heads=1), Hardware(**BOX), Policy(batch_tokens=64, chunk_size=1024),
             params=[(4096, True)])
