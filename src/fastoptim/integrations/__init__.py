"""Glue for other libraries. fastoptim never imports these submodules itself, so it never depends on their
libraries: ``fastoptim.integrations.timm.register()`` (timm's optimizer factory) imports timm when called;
``fastoptim.integrations.lightning`` (a Lightning callback for gradient release) imports Lightning when imported."""
