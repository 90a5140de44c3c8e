"""The embedded default model (``dsa/data/default``): the shipped checkpoint loads in DSAModel, dsa.LLM and
transformers' DeepseekV32ForCausalLM with matching logits, stays under its size budget, and writes."""
import json
import os
import subprocess

import pytest
import torch

from dsa.model import DSAModel
from dsa.model.presets import DEFAULT_CHECKPOINT


def test_the_checkpoint_is_what_the_docs_say():
    config = json.load(open(os.path.join(DEFAULT_CHECKPOINT, "config.json")))
    assert (config["model_type"], config["num_hidden_layers"], config["num_nextn_predict_layers"]) == \
        ("deepseek_v32", 5, 1)
    assert config["index_topk"] == 512 and config["max_position_embeddings"] == 16384
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    size = sum(os.path.getsize(os.path.join(DEFAULT_CHECKPOINT, f)) for f in os.listdir(DEFAULT_CHECKPOINT))
    assert size <= 24_000_000, f"{size} bytes: over the 24 MB budget of the package data"


def test_transformers_loads_it_with_our_logits():
    transformers = pytest.importorskip("transformers")
    from dsa.serve.tokenizer import Tokenizer
    ids = torch.tensor([Tokenizer.from_pretrained(DEFAULT_CHECKPOINT).encode(
        "Mr. Speaker, Mr. Vice President, Members of Congress, my fellow Americans: the state of our union")])
    ours = DSAModel.from_pretrained(DEFAULT_CHECKPOINT, dtype=torch.float32, device="cpu",
                                    indexer_precision="exact")(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_CHECKPOINT, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert type(hf).__name__ == "DeepseekV32ForCausalLM"
    with torch.no_grad():
        ref = hf(ids).logits.float()
    cos = torch.nn.functional.cosine_similarity(ours.flatten(0, 1).double(), ref.flatten(0, 1).double(), dim=-1)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean()
    # both dequantize the FP8 blocks (W8 * scale_inv) and run fp32; a prompt shorter than index_topk,
    # so every key is selected on both sides (transformers' top-k tie order is not ours)
    assert cos.min() >= 0.9999 and agree >= 0.97, f"cosine min {cos.min():.6f}, argmax agreement {agree:.3f}"


def test_the_default_writes_english_words():
    """Seeds 0-4 at the checkpoint's sampling defaults: most words are words (the full measurement over
    seeds 0-9 is benchmarks/train_default/samples.py)."""
    import re

    import dsa
    llm = dsa.LLM(device="cpu")
    params = [dsa.SamplingParams(max_tokens=48, seed=s, **llm.generation_defaults) for s in range(5)]
    texts = [o.text for o in llm.generate(["Once upon a time"] * 5, params)]
    words = [w for t in texts for w in re.findall(r"[A-Za-z]+", t)]
    assert len(words) >= 5 * 15, texts  # text, not byte soup
    vowels = sum(bool(re.search(r"[aeiouy]", w.lower())) for w in words) / len(words)
    assert vowels >= 0.9, texts  # English-like words (the word list itself is not a test dependency)


def test_the_tracked_tree_stays_within_its_budget():
    """Every device call carries the tracked tree (64 MiB in all with what it carries beside): it stays
    <= 48 MB, so a call has room for data."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True).stdout.split(b"\0")
    sizes = {f.decode(): os.path.getsize(os.path.join(root, f.decode())) for f in files
             if f and os.path.isfile(os.path.join(root, f.decode()))}
    total = sum(sizes.values())
    largest = ", ".join(f"{name} {size / 1e6:.1f} MB" for name, size in sorted(sizes.items(), key=lambda x: -x[1])[:3])
    assert total <= 48_000_000, f"the tracked tree is {total / 1e6:.1f} MB, over 48 MB; largest: {largest}"
