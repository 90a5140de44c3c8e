"""Tiny text checkpoints for the text and server tests: a byte-level BPE ``tokenizer.json`` trained
here with ``tokenizers``, and a random ``DeepseekV32ForCausalLM`` saved by transformers."""
import json

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Hello world! Hello there, world.",
    "naïve café, crème brûlée, déjà vu", "Grüße aus München, schöne Straße", "東京は日本の首都です。",
    "emoji: 🎉🚀✨ and more 🎉", "sparse attention reads only the selected rows of the latent cache",
    "user: hi\nassistant: hello", "one two three four five six seven eight nine ten",
] * 4
SPECIAL = ["<s>", "</s>"]  # ids 0 and 1
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                 "{{ raise_exception('unknown role ' ~ m['role']) }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def train_bpe(vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on CORPUS: ``<s>`` = 0, ``</s>`` = 1, then bytes and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_tokenizer(folder, chat_template: str | None = CHAT_TEMPLATE, **config) -> int:
    """``tokenizer.json`` and ``tokenizer_config.json`` in ``folder``; returns the vocabulary size."""
    tok = train_bpe()
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False,
           "normalized": False, "rstrip": False, "single_word": False, "special": True}, "add_bos_token": True,
           "add_eos_token": False, **config}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok.get_vocab_size()


def save_text_checkpoint(folder, seed: int = 0) -> None:
    """A random DeepseekV32ForCausalLM (2 dense layers, index_topk 16) plus its tokenizer."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder)
    cfg = transformers.DeepseekV32Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=192, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=2, n_group=1,
        topk_group=1, kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        index_topk=16, index_n_heads=4, max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = transformers.DeepseekV32ForCausalLM(cfg)
    with torch.no_grad():  # wider than HF's 0.02 init, so greedy text is not one repeated token
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
