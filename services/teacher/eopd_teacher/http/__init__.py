"""The HTTP front end (FastAPI): probes and metrics (`app`), the HTTP/1.1 header deadline
(`limits`) and vLLM's `/v1/completions` (JSON <-> core types around
`serving.service.TeacherService`: `openai_compat`, with the pure shapes in `openai_format`,
`openai_generation`, `openai_logprobs`). Never imports the gRPC front end or protobuf."""
