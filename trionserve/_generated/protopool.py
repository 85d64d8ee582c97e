"""Private protobuf descriptor pool for trionserve's generated message modules.

Our ``inference.*`` messages share their full names with the ones tritonclient
registers in protobuf's default pool, so ours live in this separate pool to let
both be imported in one process without "duplicate symbol" errors.
``scripts/regen_protos.sh`` rewrites the generated ``_pb2.py`` modules to use it.
"""

from google.protobuf import descriptor_pool, symbol_database
from google.protobuf.internal import api_implementation
from google.protobuf.internal import builder as _builder

POOL = descriptor_pool.DescriptorPool()

_SYM_DB = symbol_database.SymbolDatabase(pool=POOL)


def build_top_descriptors_and_messages(file_des, module_name, module):
    """Drop-in for ``builder.BuildTopDescriptorsAndMessages`` that keeps POOL private.

    With the pure-Python protobuf runtime the stock builder registers every
    message class in the *default* symbol database (and thus the default pool),
    which would collide with tritonclient's identically named messages. The
    upb/C++ runtimes do not do that, so for them this simply delegates.
    """
    if api_implementation.Type() != "python":
        _builder.BuildTopDescriptorsAndMessages(file_des, module_name, module)
        return
    saved = _builder._sym_db
    _builder._sym_db = _SYM_DB
    try:
        _builder.BuildTopDescriptorsAndMessages(file_des, module_name, module)
    finally:
        _builder._sym_db = saved
