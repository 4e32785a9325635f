"""Rendering: the whole train step exported for an R-device mesh (`render`), its manifest
(`manifest`), a render read back and run as a step (`reader`), StableHLO read for collectives,
convolutions and MACs (`stablehlo`), IREE's compiler and runtime (`iree`), and a runner that
needs no twinstep (`runner`)."""
