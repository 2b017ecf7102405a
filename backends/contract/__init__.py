"""The shared contract at the bottom of the layers: Redis key names, codecs, settings, connections.
Imports nothing else from the project."""
