"""`python -m alpa_job data tokenize INPUT... --out FILE.bin`: run the converter, print what it wrote.

alpa_job/cli.py parses the arguments (its `_data_parser`) and hands `data` here; the work is in
tokenize.py (files -> token file) and tokenizer.py (the --tokenizer value -> an encoder).
"""

from __future__ import annotations

from alpa_job.errors import EXIT_OK


def run(args) -> int:
    from alpa_job.data.tokenize import sidecar_path, tokenize_files

    s = tokenize_files(args.inputs, args.out, tokenizer=args.tokenizer, dtype=args.token_dtype, eot=not args.no_eot)
    print(
        f"tokenized {s['files']} file(s), {s['documents']} document(s): {s['tokens']:,} tokens "
        f"({s['tokenizer']}, vocab {s['vocab_size']:,}, {s['dtype']}) -> {args.out} ({s['bytes']:,} bytes)",
        flush=True,
    )
    print(f"sidecar: {sidecar_path(args.out)}", flush=True)
    return EXIT_OK
