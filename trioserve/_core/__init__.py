"""The core: requests, events, the engine and its admission, and the thread↔Trio channel.

It knows nothing of HTTP, of the OpenAI wire format, or of any concrete backend; every
other subpackage may import it, it imports none of them.
"""
