"""Each model's own chat dialect: its Jinja chat template (rendered in a sandbox, as llama-server
renders it), its native tool-call syntax and its reasoning markers, read back from the text it
generates. Importable without llama_cpp (jinja2 only)."""
