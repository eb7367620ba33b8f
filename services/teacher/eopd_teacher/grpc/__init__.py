"""The gRPC front end (`eopd.v1.TeacherService`): the servicer (protobuf <-> core types around
`serving.service.TeacherService`), the ScoreStream loop and the interceptors (auth, status,
limits). Never imports the HTTP front end."""
