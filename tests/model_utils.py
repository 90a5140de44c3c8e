"""Tiny models shared by the model, loading and engine tests."""
import torch

from dsa import DSAConfig, DSAModel


def tiny_model(seed: int = 0, dtype=torch.float32, **overrides) -> DSAModel:
    """4 layers (FSFS: layers 1 and 3 reuse a selection), 4 heads, index_topk 16, P 16, MoE from layer 1."""
    base = dict(index_topk=16, index_topk_pattern="FSFS", indexer_precision="exact")
    return DSAModel.random(DSAConfig.tiny(**{**base, **overrides}), seed=seed, dtype=dtype, device="cpu")


def prompt(n: int, seed: int, vocab: int = 512) -> list:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sharp_model(config, seed: int) -> DSAModel:
    """Random float32 weights with the projections scaled up 8x: at HF's init a tiny model repeats one
    token and attends almost uniformly, which would hide a row read one position off; these do not."""
    m = DSAModel.random(config, seed=seed, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(8)
        for layer in m.all_layers():
            layer.self_attn.absorb()
    return m


def spec_model() -> DSAModel:
    """The speculative-decoding tests' model: 2 layers (FS), index_topk 16, no MoE, an MTP module, exact
    indexer keys, the byte vocabulary, sharp weights (seed 4)."""
    from dsa.model.byte_vocab import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE
    config = DSAConfig.tiny(num_hidden_layers=2, index_topk=16, index_topk_pattern="FS", n_routed_experts=None,
                            num_nextn_predict_layers=1, indexer_precision="exact", vocab_size=BYTE_VOCAB_SIZE,
                            bos_token_id=BYTE_BOS_ID, eos_token_id=BYTE_EOS_ID)
    return sharp_model(config, 4)


def greedy_oracle(prompts, outputs):
    """A :class:`~dsa.engine.drafter.ScriptedDrafter` ``propose_fn``: the target's own greedy
    continuation of a request's tokens, from the reference ``outputs`` (0 past their end)."""
    def propose(tokens, k):
        for p, out in zip(prompts, outputs):
            if tokens[:len(p)] == p:
                done = len(tokens) - len(p)
                return (list(out) + [0] * k)[done:done + k]
        raise AssertionError(f"no prompt starts {tokens[:6]}")
    return propose
