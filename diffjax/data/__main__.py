"""`python -m diffjax.data train-sentencepiece --output tok.model --vocab-size 8000 [--source ...]`: a tokenizer
trained on a corpus as data.source reads it (the data layer stands above the tokenizers: a DataConfig names its
tokenizer)."""

from __future__ import annotations

import sys
import time

from diffjax import command_line
from diffjax.data.config import DATA_SOURCES, DataConfig
from diffjax.data.sources import open_documents
from diffjax.tokenizers.sentencepiece_tokenizer import train_sentencepiece


def main(argv: list[str] | None = None) -> int:
    parser = command_line.ArgumentParser(prog="python -m diffjax.data", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train-sentencepiece", help="train a SentencePiece model on a corpus")
    train.add_argument("--output", required=True, help="the .model file to write")
    train.add_argument("--vocab-size", type=int, required=True, help="pieces in the vocabulary (e.g. 8000)")
    train.add_argument("--source", choices=DATA_SOURCES, default="builtin", help="as data.source in the trainer config")
    train.add_argument("--paths", nargs="*", default=(), help="files or glob patterns (text, jsonl, parquet)")
    train.add_argument("--text-field", default="text", help="jsonl / parquet / hf: the field holding a document's text")
    train.add_argument("--hf-dataset", help="--source hf: a Hub dataset name (org/name) or a local dataset directory")
    train.add_argument("--hf-config", help="--source hf: the dataset's configuration (subset), if it has several")
    train.add_argument("--hf-split", default="train", help="--source hf: the split to read (default train)")
    train.add_argument("--max-documents", type=int, default=None, help="train on the first N documents only")
    train.add_argument("--model-type", choices=("bpe", "unigram", "char", "word"), default="bpe",
                       help="SentencePiece's model type (default bpe)")
    train.add_argument("--character-coverage", type=float, default=0.9995,
                       help="share of the corpus's characters the vocabulary covers; the rarest others become "
                            "bytes or <unk> (default 0.9995)")
    train.add_argument("--no-byte-fallback", action="store_true", help="unknown characters become <unk> instead of bytes")
    args = parser.parse_args(argv)

    try:
        hf = dict(hf_dataset=args.hf_dataset, hf_config=args.hf_config, hf_split=args.hf_split) if args.source == "hf" else {}
        config = DataConfig(source=args.source, paths=tuple(args.paths), text_field=args.text_field, **hf)
    except ValueError as e:
        parser.error(str(e))
    try:
        documents = open_documents(config)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    count = len(documents) if args.max_documents is None else min(args.max_documents, len(documents))
    start = time.perf_counter()
    try:
        tokenizer = train_sentencepiece(
            (documents[i] for i in range(count)),  # one at a time: the corpus is never held as one string
            vocab_size=args.vocab_size,
            output_path=args.output,
            model_type=args.model_type,
            character_coverage=args.character_coverage,
            byte_fallback=not args.no_byte_fallback,
        )
    except ValueError as e:  # e.g. a vocabulary too small for the corpus's characters
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.output}: {tokenizer.name}, eos {tokenizer.eos_id}, bos {tokenizer.bos_id}, "
        f"{count} documents, {time.perf_counter() - start:.2f} s"
    )
    return 0


if __name__ == "__main__":
    command_line.run(main, "python -m diffjax.data")
