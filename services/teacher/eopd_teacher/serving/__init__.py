"""The teacher's service, whichever front end asks: `service.TeacherService` (score / generate on
core types), the dynamic batcher and its fair queue (`batcher`, `scheduling`), the server-wide
state, resources and metrics, and the status policy (`status`). Never imports a front end."""
