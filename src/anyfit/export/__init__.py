"""``anyfit export``: a training run, or any model folder, as a standalone model another tool can use.

A LoRA adapter is merged into its base (PEFT ``merge_and_unload``); the result is written in one dtype as a
transformers folder with the tokenizer, the generation config and a model card (README.md) that says what
the model is and how it was made. Optionally, GGUF files for llama.cpp and the tools built on it (each one
loaded back and compared with the merged model before the export counts as done), and an upload of the
folder to the Hugging Face Hub.

One concern a module, each importing only those listed before it:
``errors`` (ExportError), ``local_files`` (a model's JSON files from its folder or the hub cache),
``result`` (ExportResult, GGUFAgreement), ``run_files`` (what a training run left), ``push`` (the Hub),
``gguf_support`` (what GGUF export converts), ``request`` (every input checked: ``check_request``),
``card`` (the model card), ``gguf_vocab`` and ``gguf_writer`` (``write_gguf``), ``gguf_check``
(``check_gguf``), ``folder`` (``export``: the folder written atomically). Import from the owning module
(``from anyfit.export.folder import export``); this package file imports nothing.
"""
