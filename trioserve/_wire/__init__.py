"""The wire format: OpenAI request/response bodies, server-sent events, chat templates.

Pure functions over bytes and core types; no I/O, no Trio.
"""
