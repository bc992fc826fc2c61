"""Glue for other libraries' optimizer factories. Each submodule imports its library only when called, so
fastoptim never depends on it: ``fastoptim.integrations.timm.register()``."""
