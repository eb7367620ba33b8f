"""Code shared by the eopd services: settings loading (`settings`), model loading, tokenizer
fingerprints and the pad id (`models`), model directories for vLLM (`model_dirs`), the vLLM engine
arguments both services use (`vllm_args`), the security settings of the teacher's clients
(`client_security`), the table of logit transforms (`logits`), the one atomic file writer
(`atomic_files`) and the generated `eopd.v1` protobuf modules. Nothing here does work at import
time, and nothing needs torch to be imported."""

__version__ = "0.1.0"
