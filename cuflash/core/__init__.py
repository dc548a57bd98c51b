"""The pipeline every call travels: validate -> spec (policy picks it) -> render -> compile/cache
-> launch, one module each. Nothing here imports the entry points above it or the tools."""
