"""The op library: each op's forward (output + residuals) and its hand-written VJP, side by side.

One file per op family:
- `conv`: dense and depthwise 2-D convolution (OIHW weights, NHWC activations), two depthwise paths.
- `batchnorm`: training-mode BN split into its sync sites, eval-mode BN, the running-stat update.
- `activation`: ReLU.   - `pool`: 3x3/2 max-pool and global average pool.
- `dense`: the classifier.   - `elementwise`: residual add, drop-path and dropout masks.
- `loss`: label-smoothed softmax cross-entropy and BCE-with-logits, with their divisors;
  `value_and_cotangent` dispatches on the kind (`KINDS`).
- `precision`: the f64 / f32 / bf16 policy.
"""
