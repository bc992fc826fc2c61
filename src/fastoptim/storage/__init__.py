"""How optimizer state is stored: plain tensors, or block-wise quantized codes (``quant``)."""
