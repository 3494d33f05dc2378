"""Build step for the one C extension, ``protocol._hashes`` (batched SHA-256 for the archive's Merkle
tree; see the module's comment). Everything else is in pyproject.toml.

It links OpenSSL's libcrypto (``libssl-dev``: the same library hashlib uses). ``optional``: where it
cannot be built, the install still succeeds and :mod:`protocol.merkle` uses its pure-Python
fallbacks, which compute the same hashes more slowly (``protocol.merkle.NATIVE_HASHES`` tells which).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("protocol._hashes", ["protocol/_hashes.c"], libraries=["crypto"],
                             extra_compile_args=["-O2"], optional=True)])
