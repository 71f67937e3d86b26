output "autoscaling_group_name" {
  description = "The Spot Auto Scaling group."
  value       = module.fleet.autoscaling_group_name
}

output "checkpoint_url" {
  description = "Where checkpoints are uploaded: `spotguard list <url>` shows them."
  value       = module.fleet.checkpoint_url
}
