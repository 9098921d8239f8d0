"""Loads kvtier's vLLM connector the way vLLM does: through vLLM's own
connector factory, by kv_connector_module_path. The packaging checks' vLLM
check (tools/wheel-bare-root.sh in a bare root, tools/wheel-check.sh in a
fresh venv of each wheel's Python).

Usage: python vllm_connector_check.py PREFIX   (kvtier and vLLM importable;
kvtier.vllm must be loaded from under PREFIX: the wheel's, not a build
tree's). Exit status 0 when the factory gives kvtier.vllm.KvtierConnector.
"""

import sys

import kvtier.vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

prefix = sys.argv[1]
assert kvtier.vllm.__file__.startswith(prefix), (kvtier.vllm.__file__, prefix)
config = KVTransferConfig(kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm", kv_role="kv_both")
connector = KVConnectorFactory.get_connector_class(config)
assert connector is kvtier.vllm.KvtierConnector, connector
print(f"vLLM's connector factory loaded {connector.__module__}.{connector.__name__} from {kvtier.vllm.__file__}")
