"""Python modules generated from ``proto/`` by ``bash scripts/gen_proto.sh``; do not edit.

``tests/test_proto_generated.py`` regenerates them and fails if they differ.
"""
