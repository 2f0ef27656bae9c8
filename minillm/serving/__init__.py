"""The engine behind OpenAI's HTTP API, and a load-test client for any such server (lesson 13)."""
