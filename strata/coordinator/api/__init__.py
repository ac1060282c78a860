"""The OpenAI-compatible HTTP surface: the server and its routes, the request fields and their
checks, prompts, the choices and log-probabilities of an answer, client connections, the page
at `/`. It submits requests to the engine and reaches no further.
May import: coordinator.engine, coordinator, config_error"""
