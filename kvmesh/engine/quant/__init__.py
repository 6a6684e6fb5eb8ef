"""Weight-only quantization: INT4 group-wise weights and the linear layers that use them."""
