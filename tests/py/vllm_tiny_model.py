"""Builds a tiny Llama for the vLLM tests in a directory, with nothing downloaded: random
weights (seeded, so every build is the same model) and a byte-level BPE tokenizer trained
here on a few KB of text.

    python tests/py/vllm_tiny_model.py DIR [--layers 2] [--hidden 256]
"""
import argparse
import os

TEXT = """moongate runs beside each inference rank and fronts the Mooncake store.
It sees every lookup, get and put, applies policies to them, and moves bytes over
shared memory, TCP or QUIC. Engines load prefixes through views of its memory and
store blocks through reservations in it. A block is sixteen tokens of keys and values
for every layer of the model; a prefix is a chain of blocks named by their hashes.
""" * 40


def build(out, layers, hidden, heads, kv_heads):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=8192,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                      initializer_range=0.4, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    build(a.out, a.layers, a.hidden, a.heads, a.kv_heads)
    print(f"tiny model in {a.out}")


if __name__ == "__main__":
    main()
