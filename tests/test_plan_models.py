"""Parameter counts of the shipped presets against the totals their authors publish.

Tolerance: 1% of the published figure (published totals are themselves rounded to 3 significant digits).
"""

import pytest

from orangetron.spec.hardware import gpu_names, load_gpu, make_cluster
from orangetron.spec.model import DualEncoderSpec, ModelSpec, load_model, preset_names

# (preset, published total, published active or None, source)
PUBLISHED = [
    ("llama3-8b", 8.03e9, None, "meta-llama/Meta-Llama-3-8B model card"),
    ("llama3-70b", 70.6e9, None, "meta-llama/Meta-Llama-3-70B model card"),
    ("llama3-405b", 405.9e9, None, "meta-llama/Llama-3.1-405B model card"),
    ("gpt3-175b", 175.0e9, None, "Brown et al. 2020, Table 2.1"),
    ("mixtral-8x7b", 46.7e9, 12.9e9, "Jiang et al. 2024, arXiv:2401.04088"),
    ("deepseek-v3", 671e9, 37e9, "DeepSeek-V3 technical report, arXiv:2412.19437"),
    ("gpt-oss-120b", 116.8e9, None, "gpt-oss model card, arXiv:2508.10925"),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, "Qwen3 technical report, arXiv:2505.09388"),
    ("qwen3-235b-a22b", 235e9, 22e9, "Qwen3 technical report, arXiv:2505.09388"),
]


@pytest.mark.parametrize(("name", "total", "active", "source"), PUBLISHED)
def test_preset_param_counts_match_published(name, total, active, source):
    spec = load_model(name)
    assert isinstance(spec, ModelSpec)
    assert spec.total_params() == pytest.approx(total, rel=0.01), source
    if active is not None:
        # DeepSeek's "37B" is rounded from our 37.55B: allow 2% there.
        assert spec.active_params() == pytest.approx(active, rel=0.02), source


def test_dense_models_are_fully_active():
    spec = load_model("llama3-70b")
    assert spec.active_params() == spec.total_params()
    assert spec.expert_params() == 0


def test_moe_structure_deepseek():
    spec = load_model("deepseek-v3")
    assert spec.num_moe_layers == 58  # 61 layers, first 3 dense
    assert not spec.is_moe_layer(2) and spec.is_moe_layer(3)


def test_dual_encoders_have_two_towers():
    for name in ("clip-vit-bigg14", "coca-2b", "lit-b16-text-g"):
        spec = load_model(name)
        assert isinstance(spec, DualEncoderSpec)
        assert set(spec.towers) == {"image", "text"}
    clip = load_model("clip-vit-bigg14")
    assert clip.total_params() == pytest.approx(2.54e9, rel=0.02)  # OpenCLIP ViT-bigG-14: 2.54B


def test_every_preset_loads():
    for name in preset_names():
        load_model(name)


def test_model_from_file(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text('hidden_size = 64\nnum_layers = 2\nnum_heads = 4\nffn_hidden_size = 128\nvocab_size = 100\n')
    spec = load_model(str(path))
    # 2 layers x (4*64*64 attention + 3*64*128 MLP + 2*64 norms) + 2 * 100*64 embeddings + 64 final norm
    assert spec.total_params() == 2 * (4 * 64 * 64 + 3 * 64 * 128 + 128) + 2 * 6400 + 64


@pytest.mark.parametrize(("text", "match"), [
    ("hidden_size = 64\nnum_layers = 2\n", "missing key"),
    ("hidden_size = 64\nnum_layers = 2\nnum_heads = 4\nffn_hidden_size = 8\nwidth = 3\n", "unknown key"),
    ("hidden_size = 64\nnum_layers = 2\nnum_heads = 4\nffn_hidden_size = 8\nmlp = 'relu'\n", "mlp"),
    ("hidden_size = = 3\n", "invalid TOML"),
    # A run's config file given as the model says so, rather than listing its keys as near misses of a model's.
    ("model = 'tiny'\nseq_len = 16\nbatch_size = 4\ndp = 2\n[model_source]\nx = 1\n",
     "a run's config file \\(it sets model, batch_size\\), not a model file: `train --config` and `estimate "
     "--config` take it, and --model the model it names"),
    # A quoted boolean is a non-empty string, which Python reads as true: refused, not a tied or QK-normed model.
    ("hidden_size = 64\nnum_layers = 2\nnum_heads = 4\ntied_embeddings = 'false'\n",
     "tied_embeddings = 'false': must be true or false"),
    ("hidden_size = 64\nnum_layers = 2\nnum_heads = 4\nqk_norm = 'no'\n", "qk_norm = 'no': must be true or false"),
    ("hidden_size = '64'\nnum_layers = 2\nnum_heads = 4\n", "hidden_size = '64': must be an integer"),
    ("hidden_size = 64\nnum_layers = 2\nnum_heads = 4.5\n", "num_heads = 4.5: must be an integer"),
    ("hidden_size = 64\nnum_layers = 2\nnum_heads = 4\nnorm_eps = 'x'\n", "norm_eps = 'x': must be a number"),
    ("hidden_size = 64\nnum_layers = 2\nnum_heads = 4\nmlp = 3\n", "mlp = 3: must be a string"),
    # A routing width without experts was priced as a dense model without a word.
    ("hidden_size = 64\nnum_layers = 2\nnum_heads = 4\nffn_hidden_size = 8\nvocab_size = 10\ntop_k = 2\n",
     "top_k=2: requires num_experts > 0"),
])
def test_bad_model_files_raise_value_error(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_model(str(path))


def test_unknown_presets_raise_value_error():
    with pytest.raises(ValueError, match="unknown model preset"):
        load_model("llama-9000")
    with pytest.raises(ValueError, match="unknown gpu preset"):
        load_gpu("tpu")


def test_gpu_presets():
    assert set(gpu_names()) >= {"h100", "h200", "a100-80gb", "b200", "rtx3090"}
    rtx = load_gpu("rtx3090")
    assert rtx.sms == 82 and rtx.intra_node == "pcie" and not rtx.nvls
    assert load_gpu("h100").peak_flops() == pytest.approx(989.4e12)
    cluster = make_cluster("h100", 64)
    assert cluster.nodes == 8 and cluster.nic_bytes_per_s == pytest.approx(50e9)
    with pytest.raises(ValueError, match="multiple"):
        make_cluster("h100", 12)


def test_new_gpu_presets_and_fp8_peaks():
    assert set(gpu_names()) >= {"h800", "a800", "h100-nvl", "gb200", "mi300x", "a100-40gb"}
    h800 = load_gpu("h800")
    assert h800.intra_bw_gbs == 200.0 and h800.peak_flops("float8") == pytest.approx(1978.9e12)
    assert load_gpu("gb200").gpus_per_node == 72 and load_gpu("gb200").peak_flops() == pytest.approx(2500e12)
    assert load_gpu("mi300x").peak_flops("float8") == pytest.approx(2614.9e12)
    # GB300: GB200's dense peaks (its rack's 360 / 720 PFLOPS sparse over 72 GPUs), more memory, an 800 Gb/s NIC
    gb300 = load_gpu("gb300")
    assert (gb300.peak_flops(), gb300.peak_flops("float8")) == (pytest.approx(2500e12), pytest.approx(5000e12))
    assert (gb300.gpus_per_node, gb300.nic_gbps, gb300.sms) == (72, 800.0, 160)
    assert gb300.memory_bytes > 1.4 * load_gpu("gb200").memory_bytes
    with pytest.raises(ValueError, match="no FP8"):
        load_gpu("a100-80gb").peak_flops("float8")


def test_gpu_file_optional_keys_and_unknown_keys(tmp_path):
    base = (tmp_path / "x.toml")
    text = ('name = "x"\nsms = 10\nbf16_tflops = 100.0\nfp32_tflops = 10.0\nmemory_gib = 16.0\nmemory_bw_gbs = 500.0\n'
            'intra_node = "pcie"\nintra_bw_gbs = 20.0\nnvls = false\ngpus_per_node = 4\nnic_gbps = 100.0\n'
            'gemm_efficiency = 0.7\n')
    base.write_text(text)
    gpu = load_gpu(str(base))
    assert gpu.fp8_tflops == 0.0 and gpu.attention_fwd_efficiency == 0.0
    base.write_text(text + "tensor_cores = 4\n")
    with pytest.raises(ValueError, match="unknown key"):
        load_gpu(str(base))


GPU_FILE = ('name = "x"\nsms = 10\nbf16_tflops = 100.0\nfp32_tflops = 10.0\nmemory_gib = 16.0\nmemory_bw_gbs = 500.0\n'
            'intra_node = "pcie"\nintra_bw_gbs = 20.0\nnvls = false\ngpus_per_node = 4\nnic_gbps = 100.0\n'
            'gemm_efficiency = 0.7\n')


@pytest.mark.parametrize(("line", "match"), [
    # Each was priced before: a zero divided the step time (a traceback), a negative bandwidth made it negative,
    # an efficiency typed as a percent put MFU past 100%, a quoted "false" read as true, an unknown link as NVSwitch.
    ("bf16_tflops = 0.0", r"bf16_tflops=0.0: must be a finite number > 0"),
    ("memory_bw_gbs = -1.0", r"memory_bw_gbs=-1.0: must be a finite number > 0"),
    ("nic_gbps = 0", r"nic_gbps=0: must be a finite number > 0"),
    ("intra_bw_gbs = inf", r"intra_bw_gbs=inf: must be a finite number > 0"),
    ("memory_gib = -16.0", r"memory_gib=-16.0: must be a finite number > 0"),
    ("gemm_efficiency = 70.0", r"gemm_efficiency=70.0: a share of peak, at most 1 \(0.7, not 70\)"),
    ("gemm_efficiency = 0.0", r"gemm_efficiency=0.0: must be a finite number > 0"),
    ("sms = 0", r"sms=0: must be >= 1"),
    ("sms = 10.5", r"sms=10.5: must be an integer"),
    ("gpus_per_node = 0", r"gpus_per_node=0: must be >= 1"),
    ('memory_gib = "16GiB"', r"memory_gib='16GiB': must be a number"),
    ('nvls = "false"', r"nvls='false': must be true or false"),
    ('intra_node = "nvlinkk"', r"intra_node='nvlinkk': must be one of nvswitch, nvlink, pcie"),
    ("fp8_tflops = -1.0", r"fp8_tflops=-1.0: must be a finite number >= 0"),
    ("attention_fwd_efficiency = 1.7", r"attention_fwd_efficiency=1.7: a share of peak, at most 1"),
    ("intra_bw_gbps = 20.0", r"unknown key\(s\) intra_bw_gbps \(did you mean intra_bw_gbs\?\)"),
])
def test_a_gpu_files_wrong_value_is_refused_naming_its_key(tmp_path, line: str, match: str) -> None:
    key = line.split(" = ")[0]
    path = tmp_path / "gpu.toml"
    kept = [row for row in GPU_FILE.splitlines() if row.split(" = ")[0] != key]
    path.write_text("\n".join([*kept, line]) + "\n")
    with pytest.raises(ValueError, match=rf"^gpu {path}: {match}"):
        load_gpu(str(path))
    path.write_text("\n".join([*kept, line.split(" = ")[0] + " = = 1"]) + "\n")
    with pytest.raises(ValueError, match=rf"^gpu {path}: "):  # its TOML syntax too, naming the file
        load_gpu(str(path))
