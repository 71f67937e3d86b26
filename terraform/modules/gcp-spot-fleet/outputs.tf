output "instance_group_manager" {
  description = "Self link of the regional managed instance group."
  value       = google_compute_region_instance_group_manager.this.self_link
}

output "instance_group" {
  description = "The instance group (for listing the VMs)."
  value       = google_compute_region_instance_group_manager.this.instance_group
}

output "instance_template" {
  description = "Self link of the Spot instance template."
  value       = google_compute_instance_template.this.self_link
}

output "service_account_email" {
  description = "The VMs' service account; grant it more roles for the trainer's own needs."
  value       = google_service_account.this.email
}

output "bucket_name" {
  description = "Name of the checkpoint bucket (created or given)."
  value       = local.bucket_name
}

output "checkpoint_url" {
  description = "Where checkpoints go (spotguard's bucket setting)."
  value       = local.bucket_url
}

output "peer_network_tag" {
  description = "Network tag of the fleet's VMs that the peer firewall rule opens the peer port between; null when enable_peers is false."
  value       = var.enable_peers ? local.peer_tag : null
}
