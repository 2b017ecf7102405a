"""`fleet serve`: OpenAI- and Ollama-compatible HTTP APIs in front of the fleet (docs/gateway.md).

app.py builds the ASGI app, core.py admits and follows jobs, openai_api.py and ollama_api.py
speak the two protocols, responses.py cancels the jobs of a client that leaves."""
