"""EvaByte (github.com/OpenEvaByte/evabyte) in mtpkit: exact EVA attention for decoding (`eva`: the
windowed cache behind the decoder's cache interface and the body the decoder calls) and the
fixes mtpkit applies when it loads a real EvaByte checkpoint under transformers 5.x (`load`).
The checkpoint's own remote code is what runs; mtpkit never edits its files."""
