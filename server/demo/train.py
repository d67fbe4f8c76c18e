"""Train the embedded demo model: a small LLaMA on the Python standard library's own docs.

``pagedllm serve`` with no ``--model`` serves what this script writes to
``server/demo/model/``. Everything it reads ships with CPython, so it runs offline:

* ``pydoc_data.topics`` — the language reference sections ``help()`` shows;
* the docstrings of a fixed list of standard-library modules and their public members;
* chat examples built from both ("What does json.dumps do?" -> the docstring's first
  paragraph), rendered with the model's own chat template so the chat endpoint works.

The tokenizer is a byte-level BPE trained on the same text, so any string round-trips.
The defaults below are the shipped model's (2.4M parameters, 4.7 MB of bfloat16 weights;
final training loss about 2.6). Run (about 11 minutes on two free CPU cores; 18 on two
shared ones)::

    python -m pagedllm.server.demo.train --out server/demo/model
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import random
import re
import time
from collections.abc import Iterator

SPECIALS = ("<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SYSTEM_PROMPT = "You are a helpful assistant that knows the Python documentation."
# The server's default sampling for requests that leave these unset (generation_config.json).
DEFAULT_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}
MODULES = (
    "abc argparse array ast asyncio base64 bisect builtins calendar cmath collections "
    "collections.abc colorsys concurrent.futures configparser contextlib copy csv dataclasses datetime "
    "decimal difflib dis enum filecmp fnmatch fractions functools gc getopt gettext glob gzip hashlib "
    "heapq hmac html http.client http.server imaplib importlib inspect io ipaddress itertools json "
    "keyword linecache locale logging lzma math mimetypes multiprocessing operator os os.path pathlib "
    "pickle pkgutil platform pprint queue quopri random re reprlib sched secrets select selectors "
    "shelve shlex shutil signal smtplib socket socketserver sqlite3 ssl stat statistics string "
    "struct subprocess sys tarfile tempfile textwrap threading time timeit tokenize trace traceback "
    "types typing unicodedata unittest urllib.parse urllib.request uuid warnings weakref xml.dom "
    "xml.etree.ElementTree zipfile zlib"
).split()
QUESTIONS_TOPIC = ("What is {}?", "Explain {}.", "Tell me about {}.", "How does {} work in Python?")
QUESTIONS_MODULE = ("What does the {} module do?", "What is the {} module for?", "Tell me about {}.")
QUESTIONS_MEMBER = ("What does {} do?", "Explain {}.", "How do I use {}?")


# -- the corpus -------------------------------------------------------------------------
def _clean(text: str) -> str:
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _first_paragraphs(text: str, limit: int = 500) -> str:
    out = ""
    for para in text.split("\n\n"):
        para = para.strip()
        if not para or set(para) <= set("*=-~ \n"):
            continue
        if out and len(out) + len(para) > limit:
            break
        out = f"{out}\n\n{para}" if out else para
    return out[: limit * 2]


def topic_documents() -> Iterator[tuple[str, str]]:
    """(subject, text) for every section of the language reference in ``pydoc_data``."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        text = _clean(topics[key])
        title = text.split("\n", 1)[0].strip().replace('"', "")
        yield title[0].lower() + title[1:] if title else key, text


def docstring_documents() -> Iterator[tuple[str, str, bool]]:
    """(qualified name, docstring, is_module) for the modules above and their public members."""
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        doc = inspect.getdoc(module)
        if doc:
            yield name, _clean(doc), True
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            if attr.startswith("_"):
                continue
            member = getattr(module, attr, None)
            if not (inspect.isfunction(member) or inspect.isclass(member) or inspect.isbuiltin(member)):
                continue
            if getattr(member, "__module__", name) not in (name, None) and name != "builtins":
                continue
            doc = inspect.getdoc(member)
            if doc and len(doc) > 40:
                yield f"{name}.{attr}", _clean(doc), False


def build_corpus(seed: int = 0) -> tuple[list[str], list[list[dict]]]:
    """Plain documents and chat conversations, shuffled with ``seed``."""
    rng = random.Random(seed)
    texts, chats = [], []
    for subject, text in topic_documents():
        texts.append(text)
        answer = _first_paragraphs(text.split("\n", 2)[-1])
        for question in rng.sample(QUESTIONS_TOPIC, 2):
            chats.append(_chat(rng, question.format(subject), answer))
    for name, doc, is_module in docstring_documents():
        texts.append(f"{name}\n\n{doc}")
        answer = _first_paragraphs(doc)
        questions = QUESTIONS_MODULE if is_module else QUESTIONS_MEMBER
        chats.append(_chat(rng, rng.choice(questions).format(name), answer))
    rng.shuffle(texts)
    rng.shuffle(chats)
    return texts, chats


def _chat(rng: random.Random, question: str, answer: str) -> list[dict]:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    return messages


# -- tokenizer and model ----------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=list(SPECIALS[3:]),
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(tokenizer, args: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(  # type: ignore[call-arg]  # NOTE: rope_theta is read from kwargs by transformers
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )


def token_stream(tokenizer, texts: list[str], chats: list[list[dict]]) -> list[int]:
    """All documents and conversations as one stream, interleaved, each ending in EOS."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    docs = [[bos] + tokenizer.encode(t, add_special_tokens=False) + [eos] for t in texts]
    docs += [tokenizer.apply_chat_template(c, tokenize=True, return_dict=False) for c in chats]
    random.Random(1).shuffle(docs)
    return [t for doc in docs for t in doc]


def train(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    texts, chats = build_corpus(args.seed)
    tokenizer = train_tokenizer(texts + [m["content"] for c in chats for m in c], args.vocab_size)
    stream = torch.tensor(token_stream(tokenizer, texts, chats))
    model = LlamaForCausalLM(model_config(tokenizer, args))
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{len(texts)} documents, {len(chats)} chats, {len(stream)} tokens, {params / 1e6:.2f}M parameters", flush=True
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    start = time.time()
    for step in range(args.steps):
        lr = _lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,))
        batch = torch.stack([stream[s : s + args.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  lr {lr:.2e}  {time.time() - start:6.0f}s", flush=True)
    save(model, tokenizer, args.out, args)


def _lr(step: int, args: argparse.Namespace) -> float:
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def save(model, tokenizer, out: str, args: argparse.Namespace) -> None:
    """Weights in bfloat16 safetensors (the engine computes in them where the CPU has bf16 units, else in float32)."""
    import torch

    os.makedirs(out, exist_ok=True)
    model.generation_config.do_sample = True
    for key, value in DEFAULT_SAMPLING.items():
        setattr(model.generation_config, key, value)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, "training_args.json"), "w") as f:
        json.dump(vars(args), f, indent=2, sort_keys=True)
    print(f"saved to {out}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "model"))
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    train(p.parse_args(argv))


if __name__ == "__main__":
    main()
