"""llama-server's native routes: /completion, /infill, /tokenize, /detokenize, /apply-template."""
