"""``anyfit export``: a training run, or any model folder, as a standalone model another tool can use.

A LoRA adapter is merged into its base (PEFT ``merge_and_unload``); the result is written in one dtype as a
transformers folder with the tokenizer, the generation config and a model card (README.md) that says what
the model is and how it was made. Optionally, GGUF files for llama.cpp and the tools built on it (each one
loaded back and compared with the merged model before the export counts as done), and an upload of the
folder to the Hugging Face Hub.

One concern a room, each importing only those listed before it (and this package file, which holds only the
error they share):

- ``ExportError`` (here): an input or a result that stops the export, said in one line;
- ``sharded``: a sharded checkpoint (FSDP2 or ZeRO-3) gathered into ordinary safetensors by one process;
- ``request``: what is exported and from where, every input checked before any weights load
  (``check_request``): the run's files (``RunFiles``), a model's JSON files from its folder or the hub cache,
  the GGUF types and what the writer converts (``GGUF_ARCHS``), the push target; and what an export produced
  (``ExportResult``, ``GGUFAgreement``);
- ``gguf_writer``: a model folder as one GGUF file (``write_gguf``), with llama.cpp's vocabulary and
  pre-tokenizer name (``llama_cpp_pre_tokenizer``);
- ``gguf_check``: each GGUF file loaded back and compared with the merged model (``check_gguf``);
- ``publish``: what goes out with the model: its model card (``model_card``) and the upload (``push_folder``);
- ``folder``: ``export``, the request made into a model folder written atomically, then pushed.

Import from the owning room (``from anyfit.export.folder import export``).
"""

from anyfit.config import ConfigError


class ExportError(ConfigError):
    """An export that cannot be done as asked; the message says why (printed as ``anyfit: error: ...``)."""
