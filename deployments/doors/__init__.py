"""The front doors: each decodes its wire into a `GenerationRequest`, runs it through the one `GraphRunner` and encodes
the reply. One module per door; a new door (gRPC, say) is one new module here and one line in the builder."""
