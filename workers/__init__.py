"""Workers: JetStream pull consumers that run job kinds."""
